"""The speculative parts of a step, composed into the model runner: a verifier (acceptance) and a drafter (the
head's ``propose``), plus what each needs staged per row.

One step, for context (prefill chunk) and generation rows together, after the target's forward pass:

1. verify: logits at each row's verified positions; a generation row's tokens are ``[t, d1..dD]``.
2. accept (device): the target's token at each verified position (argmax, or a sample for rows that
   cannot accept yet), longest accepted prefix, bonus token.
3. rewind: nothing to do here; the scheduler advances a row's computed length by the accepted count only,
   so the KV of rejected drafts is overwritten next step.
4. draft (device): the head runs over every token of the step with the input ids shifted left by one
   (the bonus token, a sampled first token, or the next prompt token of a non-final chunk at each row's
   last accepted position), then continues its own loop.
5. one device -> host copy: accepted counts, emitted tokens, next drafts (``StepResult`` rows).

Nothing here knows which head it runs.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from specserve.kernels.draft_inputs import draft_inputs
from specserve.models.llama import LlamaForCausalLM
from specserve.runner.cuda_graph import GraphCheck
from specserve.runner.sampler import LOGPROB_WIDTH, SamplingTensors, token_logprobs
from specserve.runner.step_batch import RowResult, SpecInputs, StepBatch, StepSwitches
from specserve.speculative.accept import AcceptInputs, accept
from specserve.speculative.config import SpeculativeConfig
from specserve.speculative.draft_len import DraftLenPolicy
from specserve.speculative.heads import DraftHead, DraftInputs, place

# per-row acceptance settings as staged (``acceptance_columns``), with their padding rows' values (greedy, nothing
# relaxed, outside the thinking phase)
ACCEPT_INTS = {"greedy": 1, "relaxed": 0, "relaxed_topk": 1, "thinking": 0}


def acceptance_columns(reqs, rows: int, spec: SpeculativeConfig) -> tuple[dict[str, list[int]], list[float]]:
    """The one route from requests to staged acceptance settings: per name (``ACCEPT_INTS``) ``rows`` values,
    and each row's relaxed delta; a request's own relaxed settings override the configuration's."""
    cols: dict[str, list[int]] = {k: [] for k in ACCEPT_INTS}
    delta: list[float] = []
    for r in reqs:
        sp = r.params
        relaxed = spec.use_relaxed_acceptance_for_thinking if sp.relaxed_acceptance is None else sp.relaxed_acceptance
        cols["greedy"].append(int(sp.greedy))
        cols["relaxed"].append(int(relaxed))
        cols["relaxed_topk"].append(sp.relaxed_topk if sp.relaxed_topk is not None else spec.relaxed_topk)
        cols["thinking"].append(int(r.thinking))
        delta.append(sp.relaxed_delta if sp.relaxed_delta is not None else spec.relaxed_delta)
    pad = rows - len(reqs)
    for k, v in ACCEPT_INTS.items():
        cols[k] += [v] * pad
    return cols, delta + [0.0] * pad


class Verifier:
    """Acceptance of a step's drafts against the target (``speculative.accept``)."""

    def __init__(self, spec: SpeculativeConfig, thinking_tokens: tuple[int, int]) -> None:
        self.forced = spec.forced_acceptance
        self.begin_token, self.end_token = thinking_tokens
        # tests only: False makes sampled acceptance keep a rejected draft in the bonus distribution (biased)
        self.remove_rejected = True

    def inputs(self, sampling: SamplingTensors, greedy, can_accept, relaxed, relaxed_topk, relaxed_delta,
               thinking, switches: StepSwitches) -> AcceptInputs:
        """Per-row settings [B] each (integer or boolean) -> the acceptance inputs, flags as booleans."""
        return AcceptInputs(
            sampling=sampling, greedy=greedy.bool(), can_accept=can_accept.bool(), relaxed=relaxed.bool(),
            relaxed_topk=relaxed_topk, relaxed_delta=relaxed_delta, thinking=thinking.bool(),
            begin_token=self.begin_token, end_token=self.end_token, max_topk=switches.max_topk,
            simple_greedy=switches.simple_greedy, remove_rejected=self.remove_rejected)

    def __call__(self, model: LlamaForCausalLM, hidden: torch.Tensor, spec: SpecInputs, out: torch.Tensor):
        """Logits at the verified positions, then acceptance -> (accepted [B], emitted [B, D+1]) written into
        ``out`` [D+2, B] where a kernel can, and the logits [B, D+1, V]."""
        b, d1 = spec.verify_idx.shape
        acc = spec.accept
        # greedy rows need the argmax only: logits in the weights' dtype (no float32 copy)
        logits_fn = model.lm_logits if acc.simple_greedy else model.compute_logits
        # a generation step's layout (1 + D tokens per row) verifies at every token: verify_idx is the identity
        # wherever acceptance reads (columns past a row's drafts repeat its last token there, and are never read)
        verified = hidden if spec.verify_all else hidden[spec.verify_idx]  # [B * (D+1), H]
        logits = logits_fn(verified).view(b, d1, -1)  # [B, D+1, V]
        return (*accept(logits, spec.drafts.view(b, d1 - 1), spec.num_drafts, acc, self.forced, out=out), logits)


class Drafter:
    """The head's draft loop after acceptance (``DraftHead.propose``), over the KV layers it owns."""

    def __init__(self, head: DraftHead, head_kv: list, block_size: int, draft_len: int, max_pos: int) -> None:
        self.head, self.head_kv = head, head_kv
        self.block_size, self.draft_len, self.max_pos = block_size, draft_len, max_pos

    def __call__(self, batch: StepBatch, hidden, aux, accepted, emitted, draft_len: int,
                 out: torch.Tensor) -> torch.Tensor:
        """-> drafts [B, d] (target ids; d = ``draft_len``, this step's), in ``out`` where the head's kernels can
        write them."""
        spec, meta = batch.spec, batch.meta
        ok = spec.accept.can_accept
        # a graph layout's table is [B, q + dv + 2] (dv: the most drafts its rows verify); drafting d > dv reads up
        # to column q + d + 1 (vanilla MTP's shifted tokens), so it gets zero columns to there
        ext = spec.ext
        more = draft_len - (spec.verify_idx.shape[1] - 1)
        if more > 0:
            ext = torch.nn.functional.pad(ext, (0, more))
        # the draft table with the bonus token, the last accepted token, the chain's slots (one kernel)
        s = draft_inputs(accepted, emitted, spec.base_col, spec.t0, spec.start, ext, ok, meta.block_tables,
                         spec.row_of_token, spec.col_of_token, self.block_size, draft_len, self.max_pos)
        x = DraftInputs(
            ids_ext=s["ext"], row_of_token=spec.row_of_token, col_of_token=spec.col_of_token,
            positions=batch.positions, meta=meta, hidden=hidden, aux=aux, last_idx=s["last_idx"],
            last_col=s["last_col"], last_pos=s["last_pos"], block_tables=meta.block_tables, draft_ok=ok,
            block_size=self.block_size, draft_len=draft_len, host_rows=spec.host_rows,
            step0_ids=s["ids0"], chain=(s["chain_pos"], s["chain_slot"]))
        return self.head.propose(x, self.head_kv, out=out)


def emitted_logprobs(logprobs: list[list[float]] | None, row: int, n: int) -> list[list[float]] | None:
    """Row ``row``'s first ``n`` emitted tokens' log-probability rows from a step's copied-back [B][(D+1) * W]."""
    if logprobs is None:
        return None
    flat = logprobs[row]
    return [flat[j * LOGPROB_WIDTH:(j + 1) * LOGPROB_WIDTH] for j in range(n)]


class SpeculatorBase:
    """What the chain's ``Speculator`` and the tree's ``TreeSpeculator`` share: the configuration's numbers, the
    verifier and the per-row acceptance settings a graph step stages."""

    tree = False  # drafts a chain

    def __init__(self, spec: SpeculativeConfig, thinking_tokens: tuple[int, int], policy=None) -> None:
        self.spec = spec
        self.draft_len = spec.max_draft_len  # D: a chain's drafts, a tree's depth
        self.num_nodes = spec.num_nodes  # drafts a row verifies at most (a chain's D, a tree's N)
        self.verifier = Verifier(spec, thinking_tokens)
        self.thinking_tokens = thinking_tokens  # ids of the thinking phase's begin / end tokens (-1: none)
        # the drafts each step proposes (a chain's D may vary by step, a tree's steps may draft chains; the engine
        # sets the costs): ``DraftLenPolicy`` or the tree's ``TreeChoice``
        self.policy = policy if policy is not None else DraftLenPolicy.from_config(spec)

    def drafts_nothing(self, sched) -> bool:
        """Whether the step just planned (``plan_step``) is a plain one: it proposes no drafts and verifies none
        (a tree step always drafts)."""
        return False

    @staticmethod
    def row_width(s) -> int:
        """The most drafts a scheduled row may verify: its own, or for a row continuing the step in flight as many
        as that step proposed, which the device may give it once it knows what that step accepted
        (``correct_record``), whatever the host expects; a step's layout must be at least that wide."""
        return max(s.num_drafts, s.after.next_drafts) if s.after is not None else s.num_drafts

    @staticmethod
    def generation_step(sched) -> bool:
        """Whether every row of a step verifies and samples (no prompt tokens): its period is a step's cost."""
        return all(s.sample and s.num_tokens == 1 + s.num_drafts and s.start >= s.request.num_prompt_tokens
                   for s in sched)

    @property
    def verify_len(self) -> int:
        """Tokens a generation row verifies: its last token and its drafts."""
        return self.spec.verify_len

    @property
    def lookahead_slots(self) -> int:
        """Positions past a row's tokens that the draft loop writes."""
        return self.spec.lookahead_slots

    def accept_fields(self, sched, rows: int, ints: dict, floats: dict) -> dict[str, list[int]]:
        """A graph step's per-row acceptance settings as record fields (padding rows: greedy, nothing to accept):
        the four flags in one field [4, B], which the step's expansion kernel turns into booleans -> the columns
        (``acceptance_columns``)."""
        cols, floats["relaxed_delta"] = acceptance_columns([s.request for s in sched], rows, self.spec)
        can_accept = [int(s.sample) for s in sched] + [0] * (rows - len(sched))  # samplers verify and draft
        ints["flags"] = can_accept + cols["greedy"] + cols["relaxed"] + cols["thinking"]
        ints["relaxed_topk"] = cols["relaxed_topk"]
        return cols

    @staticmethod
    def flags_now(sched, rows: int, flags: list[int]) -> list[int]:
        """The flags field of a record staged whole for the same rows, with each row's thinking phase as now."""
        return flags[:3 * rows] + [int(s.request.thinking) for s in sched] + [0] * (rows - len(sched))


class Speculator(SpeculatorBase):
    """Verify, accept and draft for every row of a step; held by ``ModelRunner`` (``speculator``)."""

    def __init__(self, model: LlamaForCausalLM, head: DraftHead, head_kv: list, spec: SpeculativeConfig,
                 block_size: int, thinking_tokens: tuple[int, int] = (-1, -1)) -> None:
        super().__init__(spec, thinking_tokens)
        self.drafter = Drafter(head, head_kv, block_size, self.draft_len, model.rope.cos_cache.shape[0] - 1)
        self.step_draft_len = self.draft_len  # this step's (``plan_step``)

    @property
    def aux_layers(self) -> tuple[int, ...]:
        """Target layers whose output stream the head reads."""
        return self.drafter.head.aux_layers

    @property
    def result_width(self) -> int:
        """Rows of a step's result: accepted count, D + 1 emitted tokens, D drafts."""
        return 2 * self.draft_len + 2

    def plan_step(self, sched, draft_len: int | None = None, captured: GraphCheck | None = None) -> int:
        """Before a step of the rows ``sched`` is staged -> the drafts it proposes a row (the policy's choice, or
        ``draft_len`` where given: step-cost measurements). ``captured.has(s)``: whether the step's graph exists for
        proposing s drafts a row (a generation step's for its rows and table width, verifying and drafting s; a
        prompt step's prefill graph with s as its switch)."""
        widest = max(map(self.row_width, sched), default=0) if self.policy.varies else 0
        if draft_len is None:
            # the policy weighs the graphs of the steps after this one: a choice below ``widest`` costs this step
            # nothing (it verifies and drafts ``widest``) but commits the next ones to a graph of its own D
            draft_len = self.policy.choose([s.request for s in sched], self.generation_step(sched), captured,
                                           widest)
        # where D varies, a step drafts as many as it verifies (at least): a batch size and table width then have
        # a graph per D (the start-up cost measurement captures those of its batch sizes), not one per (verified,
        # drafted) pair, each captured mid-run the first time a change of D needs it (docs/BENCHMARKS.md, adaptive
        # draft length). After a longer step the drafts past ``draft_len`` are made and dropped (the host keeps
        # ``next_drafts``); after a shorter one the rows verify their drafts in a wider layout.
        self.step_draft_len = max(draft_len, widest)
        return draft_len

    def drafts_nothing(self, sched) -> bool:
        """Whether the step just planned (``plan_step``) proposes no drafts and verifies none, nor continues a row of
        the step in flight that verifies some (whose acceptance, unknown here, would move the row back). Such a
        step is a plain one, and runs as a plain engine's would (its record, graph and sampler; no acceptance
        settings staged, no acceptance kernel, one row of results): where the head accepts badly the draft
        length stays at 0, and speculation then costs next to nothing over no speculation."""
        return self.step_draft_len == 0 and all(s.num_drafts == 0 and (s.after is None or s.after.num_drafts == 0)
                                                for s in sched)

    def cost_options(self, graphs: bool) -> dict[int, list[int] | None] | None:
        """The steps whose costs the engine measures at start (``step_costs.load_or_measure_costs``): with
        ``adaptive_draft_len`` each D in 0..max_draft_len (chains: no parents); None: none."""
        return {d: None for d in range(self.draft_len + 1)} if self.spec.adaptive_draft_len else None

    def verify_q(self, max_drafts: int) -> int:
        """Tokens a row of a generation step's graph layout takes, for rows of at most ``max_drafts`` drafts: 1 + D,
        or where the draft length varies, 1 + the step's own draft length (``plan_step``: at least
        ``max_drafts``), so that a step that drafts fewer costs less and each D has one graph."""
        return 1 + max(max_drafts, self.step_draft_len) if self.policy.varies else self.spec.verify_len

    def graph_switches(self, drafts: int) -> tuple[int, int]:
        """The switches a step proposing ``drafts`` a row runs with that a choice decides (``GraphKey.kind``):
        its draft length (-1: a plain step) and the children a node expands."""
        return drafts or -1, 1

    def step_switches(self, switches: StepSwitches) -> StepSwitches:
        """A record's switches with this step's draft length (a record restaged for the same rows keeps the
        others)."""
        return dataclasses.replace(switches, draft_len=self.step_draft_len)

    # -- host: what a step stages per row ---------------------------------------------------------------------
    def packed_shapes(self, rows: int, q: int) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[int, ...]]]:
        """The integer and float arrays a packed step stages for speculation, by name and shape: a row of at most q
        tokens verifies at most q - 1 drafts (a decoding step that drafted nothing: its token's logits alone), and
        its tokens leave room for the next D + 1 prompt tokens after them (the head's prompt lookahead)."""
        b, d = rows, self.draft_len
        dv = min(d, q - 1)
        ints = dict(verify_idx=(b, dv + 1), drafts=(b, dv), num_drafts=(b,), can_accept=(b,), base_col=(b,),
                    t0=(b,), start=(b,), ext=(b, q + d + 2), **{k: (b,) for k in ACCEPT_INTS})
        return ints, dict(relaxed_delta=(b,))

    def stage_packed(self, sched, a: dict[str, np.ndarray], f: dict[str, np.ndarray], row: np.ndarray,
                     col: np.ndarray, first: np.ndarray, switches: StepSwitches) -> StepSwitches:
        """Fill a packed step's speculative arrays (``packed_shapes``; a graph step's expansion kernel derives them
        on the device from its record): row, col [T] each token's row and column, ``a["input_ids"]`` [T] its id,
        first [B] each row's first flat index -> the step's switches with acceptance's."""
        b, d = len(sched), self.draft_len
        dv = a["verify_idx"].shape[1] - 1  # the most drafts a row verifies (``packed_shapes``)
        n = np.fromiter((s.num_tokens for s in sched), np.int64, b)
        nd = np.fromiter((s.num_drafts for s in sched), np.int64, b)
        base = first + n - 1 - nd  # flat index of the first verified position (the last known token)
        a["verify_idx"][:] = np.minimum(base[:, None] + np.arange(dv + 1), (base + nd)[:, None])
        a["num_drafts"][:] = nd
        a["base_col"][:], a["t0"][:] = n - 1 - nd, first
        a["start"][:] = np.fromiter((s.start for s in sched), np.int64, b)
        a["can_accept"][:] = np.fromiter((s.sample for s in sched), np.int64, b)  # samplers verify and draft
        cols, delta = acceptance_columns([s.request for s in sched], b, self.spec)
        f["relaxed_delta"][:] = delta
        for k, v in cols.items():
            a[k][:] = v
        # the step's tokens as laid out: ext holds each row's tokens from column 0, drafts are the last nd of them
        ext, drafts, tokens = a["ext"], a["drafts"], a["input_ids"]
        ext[:] = 0
        drafts[:] = 0
        ext[row, col] = tokens
        is_draft = col >= (n - nd)[row]
        drafts[row[is_draft], (col - (n - nd)[row])[is_draft]] = tokens[is_draft]
        for i, s in enumerate(sched):
            if not s.sample:  # prompt lookahead: the next known tokens after a non-final chunk
                nxt = s.request.token_ids[s.start + s.num_tokens:s.start + s.num_tokens + d + 1]
                ext[i, s.num_tokens:s.num_tokens + len(nxt)] = nxt
        return self._switches(switches, cols)

    def record_params(self, sched, rows: int, ints: dict, floats: dict, switches: StepSwitches) -> StepSwitches:
        """A graph step's per-row acceptance settings as record fields (``accept_fields``) -> its switches."""
        return self._switches(switches, self.accept_fields(sched, rows, ints, floats))

    def restaged(self, sched, rows: int, first: dict[str, list]) -> dict[str, list[int]]:
        """The fields of a record staged whole for the same rows (``first``) that change between steps: the flags
        (each row's thinking phase)."""
        return {"flags": self.flags_now(sched, rows, first["flags"])}

    def _switches(self, switches: StepSwitches, cols: dict[str, list[int]]) -> StepSwitches:
        return dataclasses.replace(switches, simple_greedy=switches.all_greedy and not any(cols["relaxed"]),
                                   max_topk=max(cols["relaxed_topk"]), draft_len=self.step_draft_len)

    # -- device: a step's inputs -----------------------------------------------------------------------------
    def packed_inputs(self, a: dict, f: dict, sampling: SamplingTensors, flat_index: torch.Tensor, q: int,
                      switches: StepSwitches, host_rows: list) -> SpecInputs:
        """Device views of a packed step's speculative arrays (``packed_shapes``) -> its ``SpecInputs``."""
        acc = self.verifier.inputs(sampling, a["greedy"], a["can_accept"], a["relaxed"], a["relaxed_topk"],
                                   f["relaxed_delta"], a["thinking"], switches)
        return SpecInputs(verify_idx=a["verify_idx"], verify_all=False, drafts=a["drafts"], num_drafts=a["num_drafts"],
                          base_col=a["base_col"], t0=a["t0"], start=a["start"], ext=a["ext"],
                          row_of_token=flat_index // q, col_of_token=flat_index % q, accept=acc, host_rows=host_rows,
                          draft_len=switches.draft_len)

    def graph_inputs(self, f: dict, x: dict, sampling: SamplingTensors, switches: StepSwitches, verify_all: bool,
                     host_rows: list, meta=None) -> SpecInputs:
        """Inside a graph step: its ``SpecInputs`` from the record's views ``f`` and their expansion ``x``
        (``kernels.step_inputs``); ``meta``, the step's attention layout, as it is (a chain's queries are
        causal)."""
        can_accept, greedy, relaxed, thinking = x["flags"].unbind(0)  # [B] bool each
        acc = self.verifier.inputs(sampling, greedy, can_accept, relaxed, f["relaxed_topk"], f["relaxed_delta"],
                                   thinking, switches)
        return SpecInputs(verify_idx=x["verify_idx"], verify_all=verify_all, drafts=x["drafts"],
                          num_drafts=f["num_drafts"], base_col=x["base_col"], t0=x["t0"], start=f["start"],
                          ext=x["ext"], row_of_token=x["row_of_token"].view(-1),
                          col_of_token=x["col_of_token"].reshape(-1), accept=acc, host_rows=host_rows,
                          draft_len=switches.draft_len)

    # -- device: verify, accept, draft -----------------------------------------------------------------------
    def step(self, model: LlamaForCausalLM, batch: StepBatch, hidden: torch.Tensor, aux: list) -> torch.Tensor:
        """After the target's forward pass -> the step's result by rows [1 + (D+1) + D, B]: accepted count,
        emitted tokens, drafts. On the GPU the acceptance kernel and each draft step's argmax write their rows
        in place (no concatenation kernels)."""
        d = self.draft_len
        b, dv1 = batch.spec.verify_idx.shape  # rows, 1 + the most drafts a row verifies (at most D)
        dn = batch.spec.draft_len  # drafts this step proposes (at most D; rows past it are never read)
        res = torch.empty(2 * d + 2, b, dtype=torch.int64, device=hidden.device)
        accepted, emitted, logits = self.verifier(model, hidden, batch.spec, out=res[:dv1 + 1])
        place(res[0], accepted)
        place(res[1:dv1 + 1].t(), emitted)
        if dn:  # a step that drafts nothing runs no head
            out = res[d + 2:d + 2 + dn].t()
            place(out, self.drafter(batch, hidden, aux, accepted, emitted, dn, out=out))
        k = batch.spec.accept.sampling.logprobs
        if k < 0:
            return res
        # each emitted token's log-probabilities at its verified position [B, (D+1) * LOGPROB_WIDTH]
        lp = token_logprobs(logits.reshape(b * dv1, -1), emitted.reshape(-1), k).view(b, -1)
        return res, torch.nn.functional.pad(lp, (0, (d + 1 - dv1) * LOGPROB_WIDTH))

    # -- host: the copied-back result ------------------------------------------------------------------------
    def results(self, sched, rows, logprobs: list[list[float]] | None = None) -> list[RowResult]:
        """The step's result per row ([1 + (D+1) + D] each: accepted count, emitted tokens, drafts; and where the
        step computed them, each emitted token's log-probabilities), as copied back -> per request: emitted tokens,
        drafts, counts."""
        d = self.draft_len
        out = []
        for i, (s, row) in enumerate(zip(sched, rows)):
            if not s.sample:
                out.append(RowResult([]))
                continue
            acc = row[0]
            n = s.next_drafts if s.next_drafts >= 0 else d  # the drafts its step proposed
            out.append(RowResult(list(row[1:acc + 2]), list(row[d + 2:d + 2 + n]), s.num_drafts, acc,
                                 logprobs=emitted_logprobs(logprobs, i, acc + 1)))
        return out
