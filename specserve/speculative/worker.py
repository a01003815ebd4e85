"""The one-model speculative step: verify the previous drafts, accept, and draft the next ones.

One ``execute`` per engine step, for context (prefill chunk) and generation rows together:

1. verify: the target runs every row's tokens; a generation row's tokens are ``[t, d1..dD]``.
2. accept (device): the target's token at each verified position (argmax, or a sample for rows that
   cannot accept yet), longest accepted prefix, bonus token.
3. rewind: nothing to do here; the scheduler advances a row's computed length by the accepted count only,
   so the KV of rejected drafts is overwritten next step.
4. draft (device): the head runs over every token of the step with the input ids shifted left by one
   (the bonus token, a sampled first token, or the next prompt token of a non-final chunk at each row's
   last accepted position), then continues its own loop.
5. one device -> host copy: accepted counts, emitted tokens, next drafts.

Nothing here knows which head it runs.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from specserve.cache.kv_cache import KVCache
from specserve.kernels.draft_inputs import draft_inputs
from specserve.models.llama import LlamaForCausalLM
from specserve.runner.model_runner import (GraphLayout, ModelRunner, RowResult, sampling_fields, sampling_row,
                                          sampling_switches, sampling_tensors)
from specserve.runner.staging import Staging
from specserve.scheduler.scheduler import SchedulerOutput
from specserve.speculative.accept import AcceptInputs, accept
from specserve.speculative.config import SpeculativeConfig
from specserve.speculative.heads import DraftHead, DraftInputs, place


_SPEC_NAMES = ["verify_idx", "drafts", "num_drafts", "can_accept", "base_col", "t0", "start",
               "top_k", "seeds", "offsets", "ext", "greedy", "relaxed", "relaxed_topk", "thinking"]


@dataclasses.dataclass
class _SpecStaged:
    """Acceptance and drafting inputs once uploaded (see ``Staged``) and the host-known switches."""

    offsets: list[int]  # [16] element offsets of the _SPEC_NAMES arrays in the spec int staging buffer
    rows: int  # B
    w: int  # columns of ``ext``: q + D + 2
    requests: list  # the scheduled requests (sampling parameters of the real rows)
    all_greedy: bool
    needs_filter: bool
    max_topk: int  # the largest relaxed top-k of the batch
    simple_greedy: bool  # every row greedy and none relaxed


class SpecDecodeRunner(ModelRunner):
    # tests only: False makes sampled acceptance keep a rejected draft in the bonus distribution (biased)
    remove_rejected = True

    def __init__(self, model: LlamaForCausalLM, head: DraftHead, kv_cache: KVCache, device: torch.device,
                 spec: SpeculativeConfig, thinking_tokens: tuple[int, int] = (-1, -1), **runner_kwargs) -> None:
        d = spec.max_draft_len
        self.num_drafts = d
        self.table_lookahead = d - 1  # the draft loop writes up to last_pos + D - 1
        self.graph_q_extra = d  # a graph step verifies 1 + D tokens per row
        rows = runner_kwargs.get("cuda_graph_max_rows", 0) if device.type == "cuda" else 0
        q = d + 1
        self._spec_ints = Staging(torch.int64, device, rows * (q + d + 10 + (q + d + 2) + 4) * 2)
        self._spec_floats = Staging(torch.float32, device, 8 * rows)
        super().__init__(model, kv_cache, device, **runner_kwargs)
        n = model.config.num_hidden_layers
        self.head = head
        self.head_kv = kv_cache.layer_views()[n:n + head.num_kv_layers]
        self.spec = spec
        self.forced = spec.forced_acceptance
        self.thinking_tokens = thinking_tokens

    def _staging_buffers(self) -> list:
        return [self._ints, self._floats, self._spec_ints, self._spec_floats]

    def _stage_spec(self, batch: SchedulerOutput, q: int) -> _SpecStaged:
        """Host arrays for acceptance and drafting of a packed step, uploaded (one more copy); a graph step
        derives them on the device from its record (``_graph_step_inputs``)."""
        sched = batch.scheduled
        b, d = len(sched), self.num_drafts
        w = q + d + 2
        sizes = [b * (d + 1), b * d, b, b, b, b, b, b, b, b, b * w, b, b, b, b]
        buf = self._spec_ints.reserve(sum(sizes))
        offs = np.cumsum([0] + sizes)
        a = {k: buf[offs[i]:offs[i + 1]] for i, k in enumerate(_SPEC_NAMES)}
        a["drafts"][:] = 0
        a["ext"][:] = 0
        vidx, drafts, ext = a["verify_idx"].reshape(b, d + 1), a["drafts"].reshape(b, d), a["ext"].reshape(b, w)
        fl = self._spec_floats.reserve(4 * b)
        k = len(sched)
        n = np.fromiter((s.num_tokens for s in sched), np.int64, k)
        nd = np.fromiter((s.num_drafts for s in sched), np.int64, k)
        t0 = self.row_t0  # [B]
        base = t0 + n - 1 - nd  # flat index of the first verified position (the last known token)
        vidx[:k] = np.minimum(base[:, None] + np.arange(d + 1), (base + nd)[:, None])
        a["num_drafts"][:k] = nd
        a["base_col"][:k], a["t0"][:k] = n - 1 - nd, t0
        a["start"][:k] = np.fromiter((s.start for s in sched), np.int64, k)
        a["can_accept"][:k] = np.fromiter((s.sample for s in sched), np.int64, k)  # samplers verify and draft
        a["thinking"][:k] = np.fromiter((s.request.thinking for s in sched), np.int64, k)
        for i, s in enumerate(sched):
            a["greedy"][i], a["relaxed"][i], a["relaxed_topk"][i], _, fl[3 * b + i] = self._accept_row(s.request)
            (a["top_k"][i], a["seeds"][i], a["offsets"][i]), (fl[i], fl[b + i], fl[2 * b + i]) = \
                sampling_row(s.request, self.vocab_size)
        # the step's tokens as prepare() laid them out: ext holds each row's tokens from column 0, drafts
        # are the last num_drafts of them
        row, col, tokens = self.step_tokens
        ext[row, col] = tokens
        is_draft = col >= (n - nd)[row]
        drafts[row[is_draft], (col - (n - nd)[row])[is_draft]] = tokens[is_draft]
        for i, s in enumerate(sched):
            if not s.sample:  # prompt lookahead: the next known tokens after a non-final chunk
                req = s.request
                nxt = req.token_ids[s.start + s.num_tokens:s.start + s.num_tokens + d + 1]
                ext[i, s.num_tokens:s.num_tokens + len(nxt)] = nxt
        self._spec_ints.upload(int(offs[-1]))
        self._spec_floats.upload(4 * b)
        reqs = [s.request for s in sched]
        all_greedy, needs_filter = sampling_switches(reqs)
        return _SpecStaged(offs.tolist(), b, w, reqs, all_greedy, needs_filter, int(a["relaxed_topk"].max()),
                           all_greedy and not bool(a["relaxed"].any()))

    def _accept_row(self, req) -> tuple[int, int, int, int, float]:
        """One request's acceptance settings: greedy, relaxed, relaxed top-k, thinking now, relaxed delta."""
        sp, cfg = req.params, self.spec
        relaxed = cfg.use_relaxed_acceptance_for_thinking if sp.relaxed_acceptance is None else sp.relaxed_acceptance
        return (int(sp.greedy), int(relaxed), sp.relaxed_topk if sp.relaxed_topk is not None else cfg.relaxed_topk,
                int(req.thinking), sp.relaxed_delta if sp.relaxed_delta is not None else cfg.relaxed_delta)

    def _row_params(self, sched, rows: int, ints: dict, floats: dict) -> tuple:
        """A graph step's per-row sampling and acceptance settings (padding rows: greedy, nothing to accept)
        -> the switches of its graph (simple greedy, all greedy, top-k/p filtering, largest relaxed top-k)."""
        sampling_fields(sched, rows, self.vocab_size, ints, floats)
        cols: list[list] = [[], [], [], [], []]
        for s in sched:
            for c, v in zip(cols, self._accept_row(s.request)):
                c.append(v)
        pad = rows - len(sched)
        # the four flags in one field, [4, B]: the step's expansion kernel turns them into booleans
        ints["flags"] = [int(s.sample) for s in sched] + [0] * pad  # can accept: samplers verify and draft
        for c, v in zip((cols[0], cols[1], cols[3]), (1, 0, 0)):  # greedy, relaxed, thinking now
            ints["flags"] += c + [v] * pad
        ints["relaxed_topk"] = cols[2] + [1] * pad
        floats["relaxed_delta"] = cols[4] + [0.0] * pad
        all_greedy, needs_filter = sampling_switches([s.request for s in sched])
        max_topk = max(ints["relaxed_topk"])
        return all_greedy and not any(cols[1]), all_greedy, needs_filter, max_topk

    def _step_params(self, sched, rows: int, first: dict[str, list]) -> dict[str, list[int]]:
        """``ModelRunner._step_params`` and the flags' last row: whether each row is in its thinking phase now."""
        out = super()._step_params(sched, rows, first)
        out["flags"] = first["flags"][:3 * rows] + [int(s.request.thinking) for s in sched] + [0] * (rows - len(sched))
        return out

    def _expand_args(self, f: dict, rec) -> dict:
        return dict(num_drafts=self.num_drafts, flags=f["flags"].view(4, rec.rows))

    def _graph_step_inputs(self, rec, switches: tuple, layout: GraphLayout):
        """Inside a graph step: ``_step``'s arguments from the record and its expansion (what ``_stage_spec``
        builds on the host for a packed step)."""
        f, x, inp = self.graph_views(rec)
        can_accept, greedy, relaxed, thinking = x["flags"].unbind(0)  # [B] bool each
        t = dict(verify_idx=x["verify_idx"], drafts=x["drafts"], num_drafts=f["num_drafts"], base_col=x["base_col"],
                 t0=x["t0"], start=f["start"], ext=x["ext"], row_of_token=x["row_of_token"].view(-1),
                 col_of_token=x["col_of_token"].reshape(-1), verify_all=not layout.prefill)
        simple_greedy, _, _, max_topk = switches
        acc = AcceptInputs(
            sampling=inp.sampling, greedy=greedy, can_accept=can_accept, relaxed=relaxed,
            relaxed_topk=f["relaxed_topk"], relaxed_delta=f["relaxed_delta"], thinking=thinking,
            begin_token=self.thinking_tokens[0], end_token=self.thinking_tokens[1], max_topk=max_topk,
            simple_greedy=simple_greedy, remove_rejected=self.remove_rejected,
        )
        return inp, t, acc, rec.q + self.num_drafts + 2

    def _spec_views(self, st: _SpecStaged):
        """Device views of staged acceptance and drafting inputs -> (named int views, AcceptInputs, w)."""
        o, b = st.offsets, st.rows
        dev = self._spec_ints.view(o[-1])
        t = {k: dev[o[i]:o[i + 1]] for i, k in enumerate(_SPEC_NAMES)}
        fdev = self._spec_floats.view(4 * b)
        sampling = sampling_tensors(st.requests, [t["top_k"], t["seeds"], t["offsets"]], fdev, b)
        # integer views of the staging buffer; _step turns the flags into bool tensors on the device (a graph
        # step's expansion kernel hands it booleans already, for which that is a no-op)
        acc = AcceptInputs(
            sampling=sampling, greedy=t["greedy"], can_accept=t["can_accept"],
            relaxed=t["relaxed"], relaxed_topk=t["relaxed_topk"], relaxed_delta=fdev[3 * b:4 * b],
            thinking=t["thinking"], begin_token=self.thinking_tokens[0], end_token=self.thinking_tokens[1],
            max_topk=st.max_topk, simple_greedy=st.simple_greedy, remove_rejected=self.remove_rejected,
        )
        return t, acc, st.w

    @torch.inference_mode()
    def _launch(self, batch: SchedulerOutput, layout: GraphLayout | None) -> torch.Tensor:
        sched = batch.scheduled
        self._host_rows = sched  # test heads read the scheduled rows; device heads never do
        if layout is None:
            st = self.stage(batch, with_sampling=False)
            inp = self.views(st)
            t, acc, w = self._spec_views(self._stage_spec(batch, st.q))
            flat = inp.meta.flat_index  # [T]: row * q + column (a graph step's expansion gives both directly)
            t.update(row_of_token=flat // st.q, col_of_token=flat % st.q)
            return self._step(inp, t, acc, w)
        # a replay reads the staged record in place: views are made only to capture
        rec, switches = self.stage_graph(batch, layout)
        return self.graphs.run(self.graph_key(layout, switches, rec),
                               lambda: self._step(*self._graph_step_inputs(rec, switches, layout)))

    def _results(self, sched, values: list) -> list[RowResult]:
        """The step's rows [1 + (D+1) + D, B] as copied back -> per request: accepted count, emitted tokens, drafts."""
        d = self.num_drafts
        results = []
        for s, row in zip(sched, zip(*values)):
            if not s.sample:
                results.append(RowResult([]))
                continue
            acc = row[0]
            results.append(RowResult(list(row[1:acc + 2]), list(row[d + 2:]), s.num_drafts, acc))
        return results

    def _step(self, inp, t: dict, acc_in: AcceptInputs, w: int) -> torch.Tensor:
        """Verify, accept and draft on the device -> [1 + (D+1) + D, B]: accepted count, emitted tokens, drafts."""
        b = inp.meta.query_index.shape[0]
        d = self.num_drafts
        inp.meta.new_step()
        acc_in = dataclasses.replace(acc_in, greedy=acc_in.greedy.bool(), can_accept=acc_in.can_accept.bool(),
                                     relaxed=acc_in.relaxed.bool(), thinking=acc_in.thinking.bool())
        hidden, aux = self.model(inp.input_ids, inp.positions, inp.meta, self.kv_views,
                                 aux_layers=self.head.aux_layers)
        # verify + accept
        # greedy rows need the argmax only: logits in the weights' dtype (no float32 copy)
        logits_fn = self.model.lm_logits if acc_in.simple_greedy else self.model.compute_logits
        # a generation step's layout (1 + D tokens per row) verifies at every token: verify_idx is the identity
        # wherever acceptance reads (columns past a row's drafts repeat its last token there, and are never read)
        verified = hidden if t.get("verify_all") else hidden[t["verify_idx"]]  # [B * (D+1), H]
        logits = logits_fn(verified).view(b, d + 1, -1)  # [B, D+1, V]
        sample_row = acc_in.can_accept
        # the step's result by rows [1 + (D+1) + D, B]: accepted count, emitted tokens, drafts; on the GPU the
        # acceptance kernel and each draft step's argmax write their rows (no concatenation kernels)
        res = torch.empty(2 * d + 2, b, dtype=torch.int64, device=logits.device)
        accepted, emitted = accept(logits, t["drafts"].view(b, d), t["num_drafts"], acc_in, self.forced,
                                   out=res[:d + 2])
        place(res[0], accepted)
        place(res[1:d + 2].t(), emitted)
        # draft: the draft table with the bonus token, the last accepted token, the chain's slots (one kernel)
        s = draft_inputs(accepted, emitted, t["base_col"], t["t0"], t["start"], t["ext"].view(b, w), sample_row,
                         inp.meta.block_tables, t["row_of_token"], t["col_of_token"], self.block_size, d,
                         self.model.rope.cos_cache.shape[0] - 1)
        x = DraftInputs(
            ids_ext=s["ext"], row_of_token=t["row_of_token"], col_of_token=t["col_of_token"], positions=inp.positions,
            meta=inp.meta, hidden=hidden, aux=aux, last_idx=s["last_idx"], last_col=s["last_col"],
            last_pos=s["last_pos"], block_tables=inp.meta.block_tables, draft_ok=sample_row,
            block_size=self.block_size, num_drafts=d, host_rows=self._host_rows, step0_ids=s["ids0"],
            chain=(s["chain_pos"], s["chain_slot"]),
        )
        place(res[d + 2:].t(), self.head.propose(x, self.head_kv, out=res[d + 2:].t()))  # drafts [B, D]
        return res
