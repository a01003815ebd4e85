"""Dynamic-tree speculation (EAGLE-2's rule) for EAGLE-3 and MTP-Eagle heads: ``TreeSpeculator``, composed into
the model runner in place of the chain's ``Speculator`` when ``topk`` > 1.

One step, after the target's forward pass over every row's tokens:

1. verify: a generation row's tokens are its last known token (column 0, the root) and N draft nodes; node c sits
   at position start + depth(c) and writes its KV at column c's slot, and its attention sees the keys before the
   root and those of its ancestors and itself (``AttentionMetadata.tree_bits``).
2. accept (``tree_accept``): the longest path the target agrees with, and the bonus token.
3. compact: the path's target KV moves from its nodes' columns to the positions after the root
   (``compact_path_kv``), so the cache stays indexed by position.
4. draft: head step 0 over each row's accepted chain (the known tokens, then the path), the target's hidden
   states gathered from the path's columns; then D - 1 expansions: the ``topk`` best nodes of a depth (by
   cumulative draft log-probability) each run the head for one token, at their own scratch slot past the row's
   last accepted position, seeing the keys up to it and their ancestors' scratch keys, and propose their ``topk``
   most likely children. The N candidates of highest cumulative log-probability form the next tree, sorted by
   depth (a child never scores above its parent, so the set holds every node's parent).
5. one device -> host copy: accepted count, emitted tokens, the next tree's tokens and parents.

A step whose rows all verify chains and that drafts one (a layout narrower than the tree's) runs the chain engine's
acceptance and draft loop instead (``_chain_step``), as cheap as a chain engine's step.

Generation steps run as CUDA graphs (a layout of 1 + N tokens a row; ``graph_inputs`` derives positions by depth
and the ancestor bits from the staged parents on the device), as a chain's do. Nothing here knows which head it
runs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np
import torch

from specserve.cache.kv_cache import PAD_BLOCK
from specserve.models.attention import AttentionMetadata
from specserve.models.llama import LlamaForCausalLM
from specserve.runner.sampler import LOGPROB_WIDTH, SamplingTensors, token_logprobs
from specserve.runner.step_batch import RowResult, SpecInputs, StepBatch, StepSwitches
from specserve.speculative.accept import AcceptInputs
from specserve.speculative.config import SpeculativeConfig
from specserve.speculative.heads import DraftHead, place
from specserve.speculative.speculator import (ACCEPT_INTS, Drafter, SpeculatorBase, acceptance_columns,
                                              emitted_logprobs)
from specserve.kernels.tree_draft import tree_draft_inputs
from specserve.kernels.tree_expand import Frontier, expand_depth, select_tree
from specserve.kernels.tree_layout import tree_attention_layout
from specserve.speculative.tree_accept import accept_tree, compact_path_kv
from specserve.speculative.tree_choice import TreeChoice


@dataclass
class TreeInputs:
    """What a tree step verifies and drafts from (B rows, N nodes, T flat tokens, W = q + 2)."""

    verify_idx: torch.Tensor  # [B, N+1] int64: flat index of the root and of each node (the last token for others)
    nodes: torch.Tensor  # [B, N] int64: each node's token
    parents: torch.Tensor  # [B, N] int64: each node's parent column (0: the root)
    num_nodes: torch.Tensor  # [B] int64: nodes a row verifies this step
    base_col: torch.Tensor  # [B] int64: column of the root (the row's last known token)
    t0: torch.Tensor  # [B] int64: flat index of the row's first token
    start: torch.Tensor  # [B] int64: position of the row's first token
    ext: torch.Tensor  # [B, W] int64: the row's tokens from column 0, then the next prompt tokens (lookahead)
    row_of_token: torch.Tensor  # [T] int64
    col_of_token: torch.Tensor  # [T] int64
    accept: AcceptInputs
    topk: int = 1  # host-known: children a node expands in this step's drafting (1: a chain)
    chain_len: int = 0  # host-known: a chain's drafts this step (``plan_step``); a tree's steps: D
    # host-known: every row verifies a chain and the step drafts one (a graph layout narrower than a tree's): the
    # chain engine's step (``TreeSpeculator._chain_step``)
    chains: bool = False
    host_rows: list = field(default_factory=list)


def tree_layout(parents: list[int]) -> tuple[list[int], list[int]]:
    """A row's node parents (columns, 0 the root) -> (depth of every column, its ancestor bits: bit j set where
    column j is an ancestor of it or itself), root first, as int64 values."""
    depth, bits = [0], [1]
    for c, p in enumerate(parents, start=1):
        depth.append(depth[p] + 1)
        bits.append(bits[p] | (1 << c))
    return depth, [b - (1 << 64) if b >= 1 << 63 else b for b in bits]


class TreeSpeculator(SpeculatorBase):
    """Verify a draft tree, accept a path, move its KV into place and draft the next tree, for every row of a
    step; held by ``ModelRunner`` (``speculator``) in place of ``Speculator``."""

    tree = True

    def __init__(self, model: LlamaForCausalLM, head: DraftHead, head_kv: list, target_kv: torch.Tensor,
                 spec: SpeculativeConfig, block_size: int, thinking_tokens: tuple[int, int] = (-1, -1)) -> None:
        if not head.tree_drafts:
            raise ValueError("tree drafting (topk > 1) needs an EAGLE-3 or MTP-Eagle head, not vanilla MTP")
        super().__init__(spec, thinking_tokens, TreeChoice(spec))
        self.head, self.head_kv, self.target_kv = head, head_kv, target_kv
        self.block_size = block_size
        self.topk = spec.topk
        self.max_pos = model.rope.cos_cache.shape[0] - 1
        # a step whose rows verify chains and that drafts one runs the chain engine's draft loop (``_chain_step``)
        self.drafter = Drafter(head, head_kv, block_size, self.draft_len, self.max_pos)
        # this step's drafting and width (``plan_step``): children a node expands, a chain's drafts, tokens a row
        self.step_topk, self.step_chain, self.step_q = self.topk, self.draft_len, 1 + self.num_nodes
        self._chain_tails: dict[int, torch.Tensor] = {}  # ``_chain_step``'s constant rows, by chain length

    @property
    def aux_layers(self) -> tuple[int, ...]:
        return self.head.aux_layers

    @property
    def result_width(self) -> int:
        """Rows of a step's result: accepted count, D + 1 emitted tokens, N node tokens, N parents."""
        return 2 + self.draft_len + 2 * self.num_nodes

    def plan_step(self, sched, draft_len: int | None = None, captured=None) -> int:
        """Whether a step drafts the tree or a chain (a tree of one child a node) and of how many drafts:
        ``TreeChoice``'s choice (which weighs the graphs ``captured`` has), or ``draft_len`` where a caller chooses
        (more than D: the tree; d: a chain of d) -> the drafts it proposes a row at most. The step runs and drafts
        as ``TreeChoice.step_graph`` says: at least as wide as its rows verify (a chain longer than chosen is cut
        to the choice on the host, ``results``: every row's ``next_drafts``)."""
        widest = self._verify_width(sched)
        if draft_len is None:
            drafts = self.policy.choose([s.request for s in sched], self.generation_step(sched), captured, widest)
            tree = self.policy.tree
        else:
            drafts, tree = draft_len, draft_len > self.draft_len
        self.step_topk = self.topk if tree else 1
        self.step_q, self.step_chain = (1 + self.num_nodes, self.draft_len) if tree else self.policy.step_graph(
            widest, drafts - 1)
        return self.num_nodes if tree else drafts

    def _verify_width(self, sched) -> int:
        """The most drafts a row of the step verifies (what the step before proposed), or N where a row verifies a
        tree, not a chain (its own tree, or the tree the step in flight drafts for it): such a step runs at the
        tree's width, so a narrower layout holds chains alone (``graph_inputs``). A row continuing the step in
        flight counts by that step's drafting (``row_width``)."""
        d, widest = self.draft_len, 0
        for s in sched:
            if s.after is not None and s.after.next_drafts > d or (
                    s.after is None and s.num_drafts and s.request.spec_parents is not None):
                return self.num_nodes
            widest = max(widest, self.row_width(s))
        return widest

    def cost_options(self, graphs: bool) -> dict[int, list[int] | None] | None:
        """Where the engine runs CUDA graphs and ``tree_max_batch_size`` is None: a step of each chain length and a
        tree step (``TreeChoice.options``), whose measured costs the choice weighs."""
        return self.policy.options() if graphs and self.spec.measures_tree_costs else None  # None where N = D

    def graph_switches(self, drafts: int) -> tuple[int, int]:
        """As the chain's: ``drafts`` past D draft the tree (no draft length switch, -1; ``topk`` children a
        node), else a chain of that many."""
        return (-1, self.topk) if drafts > self.draft_len else (drafts, 1)

    def step_switches(self, switches: StepSwitches) -> StepSwitches:
        """A record's switches with this step's drafting (the tree, or a chain and its drafts)."""
        return dataclasses.replace(switches, draft_topk=self.step_topk,
                                   draft_len=-1 if self.step_topk > 1 else self.step_chain)

    def verify_q(self, max_drafts: int) -> int:
        """A generation layout's tokens a row: the step's width (``plan_step``), at least 1 + ``max_drafts``."""
        return max(self.step_q, 1 + max_drafts)

    # -- host: a packed step's arrays ------------------------------------------------------------------------
    def packed_shapes(self, rows: int, q: int) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[int, ...]]]:
        b, n = rows, self.num_nodes
        ints = dict(verify_idx=(b, n + 1), nodes=(b, n), parents=(b, n), num_nodes=(b,), can_accept=(b,),
                    base_col=(b,), t0=(b,), start=(b,), ext=(b, q + 2), tree_bits=(b, q), tree_base=(b,),
                    **{k: (b,) for k in ACCEPT_INTS})
        return ints, dict(relaxed_delta=(b,))

    def stage_packed(self, sched, a: dict[str, np.ndarray], f: dict[str, np.ndarray], row: np.ndarray,
                     col: np.ndarray, first: np.ndarray, switches: StepSwitches) -> StepSwitches:
        """Fill a packed step's tree arrays (``packed_shapes``); a row with nodes gets positions by depth and
        ancestor bits, the others the causal rule (bits -1)."""
        b, n = len(sched), self.num_nodes
        counts = np.fromiter((s.num_tokens for s in sched), np.int64, b)
        nd = np.fromiter((s.num_drafts for s in sched), np.int64, b)
        starts = np.fromiter((s.start for s in sched), np.int64, b)
        base = counts - 1 - nd
        a["verify_idx"][:] = first[:, None] + np.minimum(base[:, None] + np.arange(n + 1), (counts - 1)[:, None])
        a["num_nodes"][:], a["base_col"][:], a["t0"][:], a["start"][:] = nd, base, first, starts
        a["can_accept"][:] = np.fromiter((s.sample for s in sched), np.int64, b)
        a["tree_base"][:] = starts + base
        cols, delta = acceptance_columns([s.request for s in sched], b, self.spec)
        f["relaxed_delta"][:] = delta
        for k, v in cols.items():
            a[k][:] = v
        a["nodes"][:], a["parents"][:], a["tree_bits"][:] = 0, 0, -1
        ext, tokens = a["ext"], a["input_ids"]
        ext[:] = 0
        ext[row, col] = tokens
        for i, s in enumerate(sched):
            req = s.request
            if s.num_drafts:
                parents = _parents_of(req, s.num_drafts)
                depth, bits = tree_layout(parents)
                lo = base[i]
                a["nodes"][i, :s.num_drafts] = req.spec_token_ids[:s.num_drafts]
                a["parents"][i, :s.num_drafts] = parents
                a["tree_bits"][i, lo:lo + len(bits)] = bits
                flat = first[i] + lo
                a["positions"][flat:flat + len(depth)] = starts[i] + lo + np.asarray(depth)
            elif not s.sample:  # prompt lookahead: the next known token after a non-final chunk
                nxt = req.token_ids[s.start + s.num_tokens:s.start + s.num_tokens + 1]
                ext[i, s.num_tokens:s.num_tokens + len(nxt)] = nxt
        return self._switches(switches)

    def _switches(self, switches: StepSwitches) -> StepSwitches:
        return self.step_switches(dataclasses.replace(switches, simple_greedy=switches.all_greedy))

    def packed_inputs(self, a: dict, f: dict, sampling: SamplingTensors, flat_index: torch.Tensor, q: int,
                      switches: StepSwitches, host_rows: list) -> TreeInputs:
        acc = self.verifier.inputs(sampling, a["greedy"], a["can_accept"], a["relaxed"], a["relaxed_topk"],
                                   f["relaxed_delta"], a["thinking"], switches)
        return TreeInputs(verify_idx=a["verify_idx"], nodes=a["nodes"], parents=a["parents"],
                          num_nodes=a["num_nodes"], base_col=a["base_col"], t0=a["t0"], start=a["start"],
                          ext=a["ext"], row_of_token=flat_index // q, col_of_token=flat_index % q, accept=acc,
                          topk=switches.draft_topk, chain_len=self._chain_len(switches), host_rows=host_rows)

    # -- graph steps: the record's fields and their device views ----------------------------------------------
    def record_params(self, sched, rows: int, ints: dict, floats: dict, switches: StepSwitches) -> StepSwitches:
        """A graph step's per-row acceptance settings (``accept_fields``) and the trees' parents [B * N] as record
        fields."""
        self.accept_fields(sched, rows, ints, floats)
        ints["parents"] = self._parents(sched, rows)
        return self._switches(switches)

    def restaged(self, sched, rows: int, first: dict[str, list]) -> dict[str, list[int]]:
        """The fields that change between graph steps of the same rows: the flags (thinking phase) and parents."""
        return {"flags": self.flags_now(sched, rows, first["flags"]), "parents": self._parents(sched, rows)}

    def _parents(self, sched, rows: int) -> list[int]:
        """Every row's tree parents, padded to N (rows without nodes, padding rows, and rows that continue the
        step in flight, whose tree the device takes from that step: zeros)."""
        n = self.num_nodes
        out: list[int] = []
        for s in sched:
            got = _parents_of(s.request, s.num_drafts) if s.num_drafts and s.after is None else []
            out += got + [0] * (n - len(got))
        return out + [0] * (n * (rows - len(sched)))

    def graph_inputs(self, f: dict, x: dict, sampling: SamplingTensors, switches: StepSwitches, verify_all: bool,
                     host_rows: list, meta: AttentionMetadata) -> TreeInputs:
        """Inside a graph step: its ``TreeInputs`` from the record's views ``f`` and their expansion ``x``; a row
        with nodes gets positions by depth (in place, in the step's positions) and its tree's ancestor bits (in
        ``meta``)."""
        n = x["drafts"].shape[1]  # the layout's drafts a row (N, or a chain's where all rows verify chains)
        parents = f["parents"].view(-1, self.num_nodes)[:, :n]
        chains = n < self.num_nodes  # (``_verify_width``): a chain's positions by depth are its columns'
        if not chains:
            # the mask's positions stay the columns' (expand_record's one tensor for both): a copy before the
            # nodes' positions by depth are written in place
            meta.query_pos, meta.tree_bits = tree_attention_layout(parents, f["num_drafts"], f["start"],
                                                                   x["positions"], self.draft_len)
            meta.tree_base = f["start"]
        can_accept, greedy, relaxed, thinking = x["flags"].unbind(0)
        acc = self.verifier.inputs(sampling, greedy, can_accept, relaxed, f["relaxed_topk"], f["relaxed_delta"],
                                   thinking, switches)
        return TreeInputs(verify_idx=x["verify_idx"], nodes=x["drafts"], parents=parents,
                          num_nodes=f["num_drafts"], base_col=x["base_col"], t0=x["t0"], start=f["start"], ext=x["ext"],
                          row_of_token=x["row_of_token"].view(-1), col_of_token=x["col_of_token"].reshape(-1),
                          accept=acc, topk=switches.draft_topk, chain_len=self._chain_len(switches),
                          chains=chains, host_rows=host_rows)

    def _chain_len(self, switches: StepSwitches) -> int:
        """The depths a step's drafting runs: a chain's drafts, or D for a tree."""
        return self.draft_len if switches.draft_topk > 1 else switches.draft_len

    # -- device: verify, accept, compact, draft --------------------------------------------------------------
    def step(self, model: LlamaForCausalLM, batch: StepBatch, hidden: torch.Tensor, aux: list) -> torch.Tensor:
        """After the target's forward pass -> the step's result by rows [2 + D + 2N, B]."""
        x, meta = batch.spec, batch.meta
        if x.chains:  # (a layout of chains alone drafts a chain: a tree's drafting runs at the tree's width)
            return self._chain_step(model, batch, hidden, aux)
        b, n1 = x.verify_idx.shape
        d, n = self.draft_len, self.num_nodes
        logits_fn = model.lm_logits if x.accept.simple_greedy else model.compute_logits
        logits = logits_fn(hidden[x.verify_idx.reshape(-1)]).view(b, n1, -1)  # [B, N+1, V]
        res = accept_tree(logits, x.nodes, x.parents, x.num_nodes, d, self.topk, x.accept)
        root_pos = x.start + x.base_col
        compact_path_kv(self.target_kv, meta.block_tables, root_pos, res.path, res.accepted, self.block_size)
        nodes, parents = self.draft(batch, hidden, aux, res)
        if nodes.shape[1] < n:  # a chain: the unused nodes hang below its deepest one (never kept: ``results``)
            c, pad = nodes.shape[1], n - nodes.shape[1]
            nodes = torch.cat((nodes, torch.zeros_like(nodes[:, :1]).expand(b, pad)), 1)
            parents = torch.cat((parents, torch.full_like(parents[:, :1], c).expand(b, pad)), 1)
        out = torch.cat((res.accepted[None], res.emitted.t(), nodes.t(), parents.t()))  # [2 + D + 2N, B]
        k = x.accept.sampling.logprobs
        if k < 0:
            return out
        # each emitted token's log-probabilities at its column (the root, then the path) [B, (D+1) * LOGPROB_WIDTH]
        cols = torch.cat((torch.zeros_like(res.path[:, :1]), res.path), 1)  # [B, D+1]
        at = logits.gather(1, cols[..., None].expand(b, d + 1, logits.shape[-1]))  # [B, D+1, V]
        return out, token_logprobs(at.reshape(b * (d + 1), -1), res.emitted.reshape(-1), k).view(b, -1)

    def _chain_step(self, model: LlamaForCausalLM, batch: StepBatch, hidden: torch.Tensor, aux: list):
        """A step whose rows all verify chains and that drafts a chain of c (``TreeInputs.chains``): the chain
        engine's own acceptance and draft loop (``speculator.Verifier``, ``Drafter``: a step as cheap as a chain
        engine's; nothing to move in the cache), its result laid out as a tree step's: accepted, D + 1 emitted
        (those past the layout's never read), the chain then zeros, parents 0..c-1 then c (below the chain)."""
        x = batch.spec
        b, q = x.verify_idx.shape  # q = 1 + c: the layout verifies the widest chain and drafts as many
        d, n, c = self.draft_len, self.num_nodes, x.chain_len
        spec = SpecInputs(verify_idx=x.verify_idx, verify_all=True, drafts=x.nodes, num_drafts=x.num_nodes,
                          base_col=x.base_col, t0=x.t0, start=x.start, ext=x.ext, row_of_token=x.row_of_token,
                          col_of_token=x.col_of_token, accept=x.accept, host_rows=x.host_rows, draft_len=c)
        res = torch.empty(2 + d + 2 * n, b, dtype=torch.int64, device=hidden.device)
        accepted, emitted, logits = self.verifier(model, hidden, spec, out=res[:q + 1])
        place(res[0], accepted)
        place(res[1:q + 1].t(), emitted)
        out = res[d + 2:d + 2 + c].t()
        place(out, self.drafter(dataclasses.replace(batch, spec=spec), hidden, aux, accepted, emitted, c, out=out))
        res[d + 2 + c:] = self._chain_tail(c, hidden.device)[:, None]  # one copy, not a kernel per piece
        k = x.accept.sampling.logprobs
        if k < 0:
            return res
        lp = token_logprobs(logits.reshape(b * q, -1), emitted.reshape(-1), k).view(b, -1)
        return res, torch.nn.functional.pad(lp, (0, (d + 1 - q) * LOGPROB_WIDTH))

    def _chain_tail(self, c: int, device: torch.device) -> torch.Tensor:
        """What a chain of c's result holds past its drafts, the same every step [2N - c]: zeros for the nodes it
        leaves empty, then the parents 0..c-1, c, ..., c. Made once, by the eager run that precedes a graph's capture
        (``CudaGraphs.run``), so the graph reads a tensor that lives as long as the speculator."""
        if c not in self._chain_tails:
            n = self.num_nodes
            tail = torch.cat((torch.zeros(n - c, dtype=torch.int64), torch.arange(n).clamp(max=c)))
            self._chain_tails[c] = tail.to(device)
        return self._chain_tails[c]

    def draft(self, batch: StepBatch, hidden: torch.Tensor, aux: list, res) -> tuple[torch.Tensor, torch.Tensor]:
        """Head step 0 over each row's accepted chain, then the tree's expansion -> next nodes, parents [B, N]."""
        x, meta = batch.spec, batch.meta
        head, bs = self.head, self.block_size
        ok = x.accept.can_accept
        chain_len = x.base_col + 1 + torch.where(ok, res.accepted, 0)  # [B]: the known tokens, then the path
        # per token [T]: its target state, position, slot and head input token along the chain (known tokens, the
        # path's nodes and the bonus; a non-final chunk keeps its lookahead token after the chunk)
        src, pos, slot, ids0 = tree_draft_inputs(x.ext, x.base_col, ok, res.accepted, res.emitted, res.path, x.t0,
                                                 x.start, x.row_of_token, x.col_of_token, meta.block_tables, bs)
        h = head.first_hidden(hidden[src], [t[src] for t in aux])
        meta0 = AttentionMetadata(slot_mapping=slot, block_tables=meta.block_tables, query_index=meta.query_index,
                                  query_pos=meta.query_pos, flat_index=meta.flat_index,
                                  sliding_window=meta.sliding_window, backend=meta.backend)
        last_idx = x.t0 + chain_len - 1
        last_pos = x.start + chain_len - 1
        one = _one_query(meta, last_pos, slot[:0], meta.block_tables)
        out = head.run_module(0, ids0, pos, h, meta0, self.head_kv[head.kv_layer(0)], rows=(last_idx, one))  # [B, H]
        return self.expand(out, last_pos, ok, meta, x.topk, x.chain_len)

    def expand(self, last: torch.Tensor, last_pos: torch.Tensor, ok: torch.Tensor, meta: AttentionMetadata,
               k: int, chain_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The tree's expansion from each row's head output at its last accepted token ``last`` [B, H], ``k``
        children a node -> nodes, parents [B, N] (a chain, k = 1: [B, ``chain_len``]) (module docstring,
        step 4)."""
        head, bs = self.head, self.block_size
        b = last.shape[0]
        dev = last.device
        ids = head.target_ids()
        zeros = torch.zeros(b, 1, dtype=torch.int64, device=dev)
        root = Frontier(tok=zeros, score=torch.zeros(b, 1, device=dev), ids=zeros - 1, bits=zeros,
                        hidden=last[:, None])
        # a chain (k = 1) has nothing to rank: each depth's argmax, through the head's draft output layer as the
        # chain's own draft loop takes it (its fused argmax, not the logits, a log-softmax and two top-k kernels)
        chain = [head.draft_ids(0, last)] if k == 1 else None  # each depth's token [B]
        depths = self.draft_len if chain is None else chain_len
        if chain is not None and depths == 1:
            return chain[0][:, None], torch.zeros_like(chain[0][:, None])
        if chain is not None:
            f = dataclasses.replace(root, tok=chain[0][:, None])
        else:
            # every candidate's token, score and parent's candidate id [B, C]: k at depth 1, then k * k a depth
            c = k + (self.draft_len - 1) * k * k
            cand_tok = torch.empty(b, c, dtype=torch.int64, device=dev)
            cand_score = torch.empty(b, c, dtype=torch.float32, device=dev)
            cand_par = torch.empty(b, c, dtype=torch.int64, device=dev)
            f = expand_depth(head.raw_logits(0, last), root, k, ids, 0, cand_tok, cand_score, cand_par)
        base = last_pos + 1  # [B]: the first scratch slot's position
        tables = meta.block_tables.repeat_interleave(k, dim=0)  # [B * k, M]
        # every depth's scratch columns, positions, slots and RoPE positions at once (a few kernels, not a few a
        # depth), laid out [depth, B * k] so that each depth reads contiguous rows
        steps = depths - 1
        col = torch.arange(steps * k, device=dev).view(steps, 1, k)  # [D-1, 1, k]
        col_bit = 1 << col  # [D-1, 1, k]
        spos = (base[None, :, None] + col).clamp(max=self.max_pos)  # [D-1, B, k]
        blk = meta.block_tables.gather(1, (spos // bs).clamp(max=meta.block_tables.shape[1] - 1).permute(1, 0, 2)
                                       .reshape(b, -1)).view(b, steps, k).transpose(0, 1)
        slot = torch.where(ok[None, :, None], blk * bs + spos % bs, PAD_BLOCK * bs).reshape(steps, b * k)
        rope = (last_pos[None, :] + torch.arange(1, steps + 1, device=dev)[:, None]).clamp(
            max=self.max_pos).repeat_interleave(k, dim=1)  # [D-1, B * k], a copy (kernels read a row a token)
        spos = spos.reshape(steps, b * k, 1)
        flat = torch.arange(b * k, device=dev)
        tree_base = base.repeat_interleave(k)
        next_id = k
        for depth in range(1, depths):
            f.bits = f.bits | col_bit[depth - 1]  # [B, k]: the scratch columns this depth's nodes see
            m = AttentionMetadata(slot_mapping=slot[depth - 1], block_tables=tables, query_index=flat[:, None],
                                  query_pos=spos[depth - 1], flat_index=flat, sliding_window=meta.sliding_window,
                                  backend=meta.backend, tree_bits=f.bits.reshape(-1, 1), tree_base=tree_base)
            out = head.run_module(depth, f.tok.reshape(-1), rope[depth - 1], f.hidden.reshape(b * k, -1), m,
                                  self.head_kv[head.kv_layer(depth)])  # [B * k, H]
            f.hidden = out.view(b, k, -1)
            if chain is not None:
                chain.append(head.draft_ids(depth, out))
                f.tok = chain[-1][:, None]
                continue
            f = expand_depth(head.raw_logits(depth, out), f, k, ids, next_id, cand_tok, cand_score, cand_par)
            next_id += k * k
        if chain is not None:  # node j's parent is column j (the root's child first)
            return torch.stack(chain, 1), torch.arange(depths, device=dev).expand(b, -1)
        # each candidate's depth: k at depth 1, then k * k a depth
        cand_depth = self._candidate_depths(k, dev).expand(b, -1)
        return select_tree(cand_tok, cand_par, cand_score, cand_depth, self.num_nodes)

    def _candidate_depths(self, k: int, dev) -> torch.Tensor:
        """[1, C]: the depth of each expansion candidate (k at depth 1, then k * k at each depth), made once."""
        key = (k, str(dev))
        cache = self.__dict__.setdefault("_depths", {})
        if key not in cache:
            with torch.inference_mode(False):
                d = [1] * k + [depth + 1 for depth in range(1, self.draft_len) for _ in range(k * k)]
                cache[key] = torch.tensor([d], dtype=torch.int64, device=dev)
        return cache[key]

    # -- host: the copied-back result ------------------------------------------------------------------------
    def results(self, sched, rows, logprobs: list[list[float]] | None = None) -> list[RowResult]:
        """Each row's result [2 + D + 2N] (and its emitted tokens' log-probabilities, where the step computed them)
        -> per request: emitted tokens, the next tree, counts."""
        d, n = self.draft_len, self.num_nodes
        out = []
        for i, (s, row) in enumerate(zip(sched, rows)):
            if not s.sample:
                out.append(RowResult([]))
                continue
            acc = row[0]
            # the drafts this step verified are still the request's (a chain's: no parents)
            verified = s.request.spec_parents
            depth = s.num_drafts if verified is None else max(tree_depths(verified[:s.num_drafts]), default=0)
            # the drafts its step proposed: the tree's N, or the chain's chosen length (it may have drafted more),
            # whose parents are left out (a chain: ``Request.spec_parents``)
            keep = s.next_drafts if s.next_drafts >= 0 else n
            tree = keep > d or n == d  # (a tree of D nodes drafts its chains with parents too)
            parents = list(row[d + 2 + n:d + 2 + n + keep]) if tree else None
            out.append(RowResult(list(row[1:acc + 2]), list(row[d + 2:d + 2 + keep]), s.num_drafts, acc,
                                 parents=parents, depth=depth,
                                 logprobs=emitted_logprobs(logprobs, i, acc + 1)))
        return out


def _one_query(meta: AttentionMetadata, pos: torch.Tensor, slots: torch.Tensor, tables) -> AttentionMetadata:
    """One query per row at ``pos`` [B] (head step 0's attention at each row's last chain token)."""
    rows = torch.arange(pos.shape[0], device=pos.device)
    return AttentionMetadata(slot_mapping=slots, block_tables=tables, query_index=rows[:, None],
                             query_pos=pos[:, None], flat_index=rows, sliding_window=meta.sliding_window,
                             backend=meta.backend)


def _parents_of(req, n: int) -> list[int]:
    """A request's first ``n`` drafts' parent columns (a chain, no parents: each node's the one before)."""
    return list(range(n)) if req.spec_parents is None else req.spec_parents[:n]


def tree_depths(parents: list[int]) -> list[int]:
    """Depth of each node (1 for the root's children) from its parent columns."""
    return tree_layout(parents)[0][1:]


__all__ = ["TreeInputs", "TreeSpeculator", "tree_depths", "tree_layout"]
