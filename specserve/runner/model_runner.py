"""The model runner: a scheduled batch -> device step inputs -> target forward -> sampled tokens.

Host work per step: a CUDA-graph step (most steps on CUDA) writes a compact record per row and uploads it in
one copy, and the device expands it (``graph_inputs``, ``kernels.step_inputs``); a packed (eager) step builds
its integer arrays with numpy and uploads them in one copy (plus one for the float sampling parameters).
Staging buffers only ever grow; the sampled tokens come back in one copy at the end. Nothing in between
reads a device value.
"""

from __future__ import annotations

import operator
import os
from dataclasses import dataclass, field

import numpy as np
import torch

from specserve.cache.kv_cache import KVCache, PAD_BLOCK
from specserve.config import cdiv
from specserve.kernels.step_inputs import expand_record
from specserve.models.attention import AttentionMetadata
from specserve.models.llama import LlamaForCausalLM
from specserve.runner.cuda_graph import CudaGraphs
from specserve.runner.graph_inputs import (Record, RestageState, record_views, restage_record, row_fields,
                                           stage_record)
from specserve.runner.sampler import SamplingTensors, sample
from specserve.runner.staging import Staging
from specserve.scheduler.scheduler import ScheduledRequest, SchedulerOutput


def sampling_row(req, vocab_size: int) -> tuple[tuple[int, int, int], tuple[float, float, float]]:
    """One request's sampling parameters as host values: (top_k, seed, output index), (temperature, top_p, min_p)."""
    sp = req.params
    return ((sp.top_k if sp.top_k > 0 else vocab_size, req.seed, req.num_output_tokens),
            (sp.temperature, sp.top_p, sp.min_p))


def sampling_switches(reqs) -> tuple[bool, bool]:
    """The host-known switches of a batch's sampling code: (every row greedy, some row filters top-k/p/min-p)."""
    return all(r.params.greedy for r in reqs), any(r.params.needs_filter for r in reqs)


def sampling_fields(sched, rows: int, vocab_size: int, ints: dict, floats: dict) -> None:
    """Every row's sampling parameters as record fields (``graph_inputs``); padding rows are greedy."""
    cols: list[list] = [[], [], [], [], [], []]
    for s in sched:
        (k, seed, off), (temp, top_p, min_p) = sampling_row(s.request, vocab_size)
        for c, v in zip(cols, (k, seed, off, temp, top_p, min_p)):
            c.append(v)
    pad = rows - len(sched)
    for name, c, v in zip(("top_k", "seeds", "offsets"), cols[:3], (vocab_size, 0, 0)):
        ints[name] = c + [v] * pad
    for name, c, v in zip(("temperature", "top_p", "min_p"), cols[3:], (0.0, 1.0, 0.0)):
        floats[name] = c + [v] * pad


def sampling_tensors(reqs, ints: list[torch.Tensor], floats: torch.Tensor, n: int | None = None) -> SamplingTensors:
    """ints = [top_k, seeds, offsets] device views [S]; floats = [temperature; top_p; min_p] device [3S].
    ``n`` (S) may exceed len(reqs): the rows past them are greedy dummies (CUDA-graph padding)."""
    n = len(reqs) if n is None else n
    all_greedy, needs_filter = sampling_switches(reqs)
    return SamplingTensors(
        temperature=floats[:n], top_p=floats[n:2 * n], min_p=floats[2 * n:3 * n], top_k=ints[0], seeds=ints[1],
        offsets=ints[2], all_greedy=all_greedy, needs_filter=needs_filter,
    )


@dataclass
class RowResult:
    """What one scheduled request got from a step."""

    tokens: list[int]  # emitted tokens, in order (empty when the row does not sample)
    drafts: list[int] = field(default_factory=list)  # drafts to verify next step
    num_drafts: int = 0  # drafts verified this step
    num_accepted: int = 0  # of those, accepted


@dataclass
class Launched:
    """A step queued on the device (``ModelRunner.launch``), to ``collect``."""

    batch: SchedulerOutput
    out: torch.Tensor | None  # its device output, copied back by ``collect``
    results: list[RowResult] | None = None  # already collected (a step run as several graph replays)


@dataclass(frozen=True)
class GraphLayout:
    """The fixed shape of a CUDA-graph step (see ``ModelRunner.prepare``)."""

    rows: int  # batch size, padded up to a captured size
    q: int  # tokens per row: 1 (decode) or 1 + D (verify), or a one-row prefill's padded token count
    table_width: int  # block-table entries per row (covers max_model_len)
    prefill: bool = False  # a one-row prefill (``_prefill_layout``), not a generation step, whatever q is


@dataclass
class _LastRecord:
    """The last graph step's record, as ``stage_graph`` staged it in full."""

    layout: GraphLayout
    requests: list  # its rows' requests, in order (compared by identity)
    version: int  # the int staging buffer's version after it was written
    record: Record
    switches: tuple
    ints: dict[str, list]  # its integer fields
    restaged: RestageState | None = None  # what the steps since have rewritten (``restage_record``)


@dataclass
class Staged:
    """A step's integer inputs once uploaded: where each array sits in the staging buffer. Device views are
    made from this (``ModelRunner.views``) only when a step runs eagerly or a CUDA graph is captured; a
    replay reads the buffers in place, so it skips the per-step cost of building tensors on the host."""

    offsets: list[int]  # [12] element offsets of the 11 arrays (ids ... offsets) in the int staging buffer
    rows: int  # B
    q: int  # tokens per row (the widest row when packed)
    table_width: int  # block-table entries per row
    samplers: list  # the requests that sample this step (their sampling parameters are staged too)
    num_sampling: int  # S: sampling rows, dummies included


@dataclass
class StepInputs:
    """One step's device inputs (views into the staging buffers)."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata
    # [S] int64: flat index of each sampling request's last token; None when every row samples and row i's last
    # token is token i (a graph layout of one token per row): ``hidden`` is read in place, one gather fewer
    logits_indices: torch.Tensor | None
    sampling: SamplingTensors | None  # None when no request samples this step


class ModelRunner:
    # block-table entries beyond a row's tokens that the step may write (the draft loop's positions)
    table_lookahead = 0
    graph_q_extra = 0  # tokens per row in a graph step beyond the one known token (drafts)

    def _staging_buffers(self) -> list:
        return [self._ints, self._floats]

    # a one-row step of at most this many prompt tokens (batch-1 serving's prefill) runs as a graph too
    prefill_graph_tokens = 512

    # a step that mixes generation rows with at most this many rows ending their prompts (requests joining
    # running ones) runs as one graph per such row plus one graph for the generation rows
    max_split_prefills = 8

    def graph_layout(self, batch: SchedulerOutput) -> GraphLayout | None:
        """The CUDA-graph layout of a generation step (or of a one-row prefill), or None to run eagerly. In a
        generation step every row samples after one known token, verifying its drafts (1 + D tokens per
        row; rows with fewer drafts, near their end, pad)."""
        if self.graphs is None:
            return None
        if all(self._generation_row(s) for s in batch.scheduled):
            return self._layout(batch, 1 + self.graph_q_extra)
        return self._prefill_layout(batch)

    @staticmethod
    def _generation_row(s: ScheduledRequest) -> bool:
        return s.sample and s.num_tokens - s.num_drafts == 1

    def _split(self, batch: SchedulerOutput) -> list[list[int]] | None:
        """Row groups of a step that no one graph fits (``graph_layout`` is None) but graphs do: each row
        that ends its prompt alone (``_prefill_layout``), then the generation rows together; None to run the
        step as it is. Only with generation rows in the step: a step of prompts alone (a burst of arrivals)
        stays one packed step."""
        if self.graphs is None or len(batch.scheduled) < 2:
            return None
        gen, pre = [], []
        for i, s in enumerate(batch.scheduled):
            (gen if self._generation_row(s) else pre).append(i)
        if not gen or len(pre) > self.max_split_prefills or self.graphs.padded_rows(len(gen)) is None:
            return None
        if any(self._prefill_layout(SchedulerOutput([batch.scheduled[i]])) is None for i in pre):
            return None
        return [[i] for i in pre] + [gen]

    def _prefill_layout(self, batch: SchedulerOutput) -> GraphLayout | None:
        """One row whose step ends its prompt (it samples) in at most ``prefill_graph_tokens`` tokens: a graph
        of that many tokens rounded up to a power of two (at least 16), the padding tokens writing only the
        pad block. An eager step costs about one host launch per kernel, 14 ms for the default model on the
        GPU machine, far more than the padding; batches of several rows with prompt tokens stay eager."""
        if len(batch.scheduled) != 1:
            return None
        s = batch.scheduled[0]
        q = max(16, 1 << (s.num_tokens - 1).bit_length())
        if not s.sample or s.num_drafts or s.num_tokens > self.prefill_graph_tokens or q > self.max_graph_q:
            return None
        return self._layout(batch, q, prefill=True)

    def _layout(self, batch: SchedulerOutput, q: int, prefill: bool = False) -> GraphLayout | None:
        """Rows padded to a captured size; block tables as wide as the longest row needs, rounded up to a
        power of two (at least 256 tokens), so that a graph's attention covers at most twice the context
        it needs and a handful of graphs serve every context length."""
        rows = self.graphs.padded_rows(len(batch.scheduled))
        if rows is None:
            return None
        la = self.table_lookahead
        need = max(cdiv(s.start + s.num_tokens + la, self.block_size) for s in batch.scheduled)
        width = min(self.graph_table_width, 1 << max(need, cdiv(256, self.block_size)).bit_length() - 1)
        if width < need:
            width = min(self.graph_table_width, width * 2)
        return GraphLayout(rows, q, max(width, need), prefill)

    def __init__(self, model: LlamaForCausalLM, kv_cache: KVCache, device: torch.device,
                 max_model_len: int | None = None, cuda_graph_max_rows: int = 0,
                 attention_backend: str = "auto", max_num_batched_tokens: int = 0,
                 capture_graphs: bool = True) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.kv_views = kv_cache.layer_views()[:model.config.num_hidden_layers]
        self.device = device
        self.block_size = kv_cache.block_size
        self.vocab_size = model.config.vocab_size
        self.sliding_window = model.config.sliding_window
        self.attention_backend = attention_backend
        max_len = max_model_len or model.config.max_position_embeddings
        # padding tokens sit at positions up to a layout's q - 1: they must stay inside the RoPE table
        self.max_graph_q = min(max_len, model.config.max_position_embeddings)
        self.graph_table_width = cdiv(max_len + 2 * self.table_lookahead + 1, self.block_size)
        rows = cuda_graph_max_rows if device.type == "cuda" else 0
        # staging sized for the largest graph step up front, so that graphs rarely need recapturing
        q = 1 + self.graph_q_extra
        self._ints = Staging(torch.int64, device, max(rows * (4 * q + self.graph_table_width + 2 * q + 4),
                                                       6 * max_num_batched_tokens) * 2)
        self._floats = Staging(torch.float32, device, 8 * rows)
        # capture_graphs False (enforce_eager): the same padded layouts, run without capture, so that turning
        # graphs off changes nothing but the launches (on bf16 weights a GEMM's row count can pick its kernel)
        self.graphs = CudaGraphs(rows, self._staging_buffers(), capture=capture_graphs) if rows else None
        # a graph step's upload captured in its graph as a copy node, so a replay needs no copy call from the
        # host (24-33 µs per step on the H200 machine's host; tokens/s +5% at batch 1 there, BENCHMARKS.md ninth
        # session); SPECSERVE_GRAPH_UPLOAD=0 makes the copy from the host instead
        self.upload_in_graph = os.environ.get("SPECSERVE_GRAPH_UPLOAD", "1") != "0"
        self._last_record: _LastRecord | None = None

    def prepare(self, batch: SchedulerOutput, with_sampling: bool = True) -> StepInputs:
        """Device inputs of a packed step (``stage`` then ``views``)."""
        return self.views(self.stage(batch, with_sampling))

    def stage(self, batch: SchedulerOutput, with_sampling: bool = True) -> Staged:
        """Build a packed step's inputs on the host and upload them (a graph step stages a compact record
        instead, ``stage_graph``); ``with_sampling=False`` leaves out the per-row sampling parameters (the
        speculative runner builds its own, for every row). Row i's tokens follow row i-1's, and the block
        tables are as wide as the longest row needs."""
        sched = batch.scheduled
        bs = self.block_size
        b = len(sched)
        q = max(s.num_tokens for s in sched)
        t = batch.total_tokens
        la = self.table_lookahead
        m = max(min(len(s.request.block_ids), cdiv(s.start + s.num_tokens + la, bs)) for s in sched)
        samplers = [s for s in sched if s.sample] if with_sampling else []
        ns = len(samplers)
        sizes = [t, t, t, t, b * m, b * q, b * q, ns, ns, ns, ns]
        buf = self._ints.reserve(sum(sizes))
        offs = np.cumsum([0] + sizes)
        ids, pos, slots, flat, tables, qidx, qpos, lidx, topk, seeds, offsets = (
            buf[offs[i]:offs[i + 1]] for i in range(len(sizes)))
        tables[:] = PAD_BLOCK
        qidx[:] = t  # padding queries read the zero row appended after the T real ones
        qpos[:] = 0
        tables2, qidx2, qpos2 = tables.reshape(b, m), qidx.reshape(b, q), qpos.reshape(b, q)
        # per row: its token ids and block-table row (Python lists); everything else is vectorised below
        starts = np.fromiter((s.start for s in sched), np.int64, b)
        counts = np.fromiter((s.num_tokens for s in sched), np.int64, b)
        first = np.cumsum(counts) - counts  # packed offset of each row's first token
        tokens: list[int] = []
        for i, s in enumerate(sched):
            req = s.request
            known = s.num_tokens - s.num_drafts
            tokens += req.token_ids[s.start:s.start + known]
            tokens += req.spec_token_ids[:s.num_drafts]
            nb = min(len(req.block_ids), cdiv(s.start + s.num_tokens + la, bs))
            tables2[i, :nb] = req.block_ids[:nb]
        row = np.repeat(np.arange(b, dtype=np.int64), counts)  # [T] row of each token
        col = np.arange(t, dtype=np.int64) - first[row]  # [T] its index within the row
        at = np.arange(t, dtype=np.int64)  # [T] its flat index
        p = starts[row] + col  # [T] its position
        ids[:] = tokens
        pos[:] = p
        slots[:] = tables2[row, p // bs] * bs + p % bs
        flat[:] = row * q + col
        qidx2[row, col] = at
        qpos2[row, col] = p
        self.step_tokens = (row, col, ids.copy())  # [T] each: row, column, token id (speculative inputs)
        last_tok = first + counts - 1  # [B] flat index of each row's last token
        self.row_t0 = first  # [B] flat index of each row's first token (speculative inputs)
        fbuf = self._floats.reserve(3 * ns) if ns else None
        for j, s in enumerate(samplers):
            (topk[j], seeds[j], offsets[j]), (fbuf[j], fbuf[ns + j], fbuf[2 * ns + j]) = \
                sampling_row(s.request, self.vocab_size)
        if ns:  # each sampling row's last token
            lidx[:] = last_tok[np.fromiter((s.sample for s in sched), bool, b)]
        self._ints.upload(int(offs[-1]))
        if ns:
            self._floats.upload(3 * ns)
        return Staged(offs.tolist(), b, q, m, [s.request for s in samplers], ns)

    def stage_graph(self, batch: SchedulerOutput, layout: GraphLayout) -> tuple[Record, tuple]:
        """Stage a graph step's compact record (``specserve.runner.graph_inputs``) -> (record, the host
        switches that pick the graph's variant)."""
        sched = batch.scheduled
        b, q, m = layout.rows, layout.q, layout.table_width
        ints, tables = row_fields(sched, b, q, self.block_size, self.table_lookahead)
        reqs = [s.request for s in sched]
        upload = not self.upload_in_graph
        last = self._last_record
        # the same requests in the same layout as the step before, nothing else staged since: their parameters are
        # in the buffer already, and only the fields that change per step are rewritten
        if (last is not None and last.layout == layout and last.version == self._ints.version
                and len(last.requests) == len(reqs) and all(map(operator.is_, last.requests, reqs))):
            ints.update(self._step_params(sched, b, last.ints))
            last.restaged = restage_record(self._ints, last.record, ints, tables, last.restaged, upload)
            return last.record, last.switches
        floats: dict[str, list[float]] = {}
        switches = self._row_params(sched, b, ints, floats)
        rec = stage_record(self._ints, sched, b, q, m, ints, tables, floats, upload=upload)
        self._last_record = _LastRecord(layout, reqs, self._ints.version, rec, switches, ints)
        return rec, switches

    def _step_params(self, sched, rows: int, first: dict[str, list]) -> dict[str, list[int]]:
        """The per-row parameters of a graph step's record that change between steps of the same requests
        (``first``: the integer fields as the first of those steps staged them): each row's output index, which
        seeds its sampling."""
        return {"offsets": [s.request.num_output_tokens for s in sched] + [0] * (rows - len(sched))}

    def graph_key(self, layout: GraphLayout, switches: tuple, rec: Record) -> tuple:
        """The graph a step replays: its layout and host switches (and, with the upload captured, the record's
        size, which the captured copy fixes)."""
        return (layout, *switches, rec.size) if self.upload_in_graph else (layout, *switches)

    def _row_params(self, sched, rows: int, ints: dict, floats: dict) -> tuple:
        """Per-row parameters of a graph step, added to ``ints`` / ``floats`` -> the host switches."""
        sampling_fields(sched, rows, self.vocab_size, ints, floats)
        return sampling_switches([s.request for s in sched])

    def graph_views(self, rec: Record) -> tuple[dict, dict, StepInputs]:
        """Inside a graph step: the record's device views, what the device derives from them
        (``expand_record``), and the step's inputs."""
        if self.upload_in_graph:  # the record's copy, captured with the step
            self._ints.upload(rec.size)
        f = record_views(self._ints, rec)
        b, q = rec.rows, rec.q
        tables = f["tables"].view(b, rec.table_width)
        x = expand_record(f["start"], f["count"], f["num_drafts"], f["tokens"].view(b, q), tables, self.block_size,
                          **self._expand_args(f, rec))
        meta = AttentionMetadata(
            slot_mapping=x["slots"].view(-1), block_tables=tables, query_index=x["flat"], query_pos=x["positions"],
            flat_index=x["flat"].view(-1), sliding_window=self.sliding_window, backend=self.attention_backend,
        )
        sampling = None
        if "top_k" in f:
            all_greedy, needs_filter = sampling_switches(rec.requests)
            sampling = SamplingTensors(temperature=f["temperature"], top_p=f["top_p"], min_p=f["min_p"],
                                       top_k=f["top_k"], seeds=f["seeds"], offsets=f["offsets"],
                                       all_greedy=all_greedy, needs_filter=needs_filter)
        # every row of a graph step samples (padding rows as greedy dummies); with one token per row, row i's last
        # token is token i
        last = None if q == 1 else x["last"]
        return f, x, StepInputs(input_ids=f["tokens"], positions=x["positions"].view(-1), meta=meta,
                                logits_indices=last, sampling=sampling)

    def _expand_args(self, f: dict, rec: Record) -> dict:
        """What ``expand_record`` derives beyond the layout (the speculative runner's drafting inputs)."""
        return {}

    def views(self, st: Staged) -> StepInputs:
        """Device views of a staged step's inputs."""
        o, b, q, ns = st.offsets, st.rows, st.q, st.num_sampling
        dev = self._ints.view(o[-1])
        d = [dev[o[i]:o[i + 1]] for i in range(len(o) - 1)]
        meta = AttentionMetadata(
            slot_mapping=d[2], block_tables=d[4].view(b, st.table_width), query_index=d[5].view(b, q),
            query_pos=d[6].view(b, q), flat_index=d[3], sliding_window=self.sliding_window,
            backend=self.attention_backend,
        )
        sampling = sampling_tensors(st.samplers, d[8:11], self._floats.view(3 * ns), ns) if ns else None
        return StepInputs(input_ids=d[0], positions=d[1], meta=meta, logits_indices=d[7], sampling=sampling)

    def execute(self, batch: SchedulerOutput) -> list[RowResult]:
        """Run one step and wait for it; returns one result per scheduled request, in schedule order."""
        return self.collect(self.launch(batch))

    def launch(self, batch: SchedulerOutput) -> Launched:
        """Queue one step on the device and return without waiting for it (``collect`` waits). A step mixing
        generation rows with a few rows that end their prompts runs as several graph replays (``_split``): on
        the GPU machine that costs a few milliseconds where one eager step costs about 14; such a step is
        collected group by group here (two groups can replay one graph, whose output buffer the second rewrites)."""
        layout = self.graph_layout(batch)
        groups = self._split(batch) if layout is None else None
        if groups is None:
            return Launched(batch, self._launch(batch, layout))
        results: list[RowResult | None] = [None] * len(batch.scheduled)
        for rows in groups:  # rows are independent: each group's results equal the packed step's
            sub = SchedulerOutput([batch.scheduled[i] for i in rows])
            for i, res in zip(rows, self.collect(Launched(sub, self._launch(sub, self.graph_layout(sub))))):
                results[i] = res
        return Launched(batch, None, results)

    def collect(self, step: Launched) -> list[RowResult]:
        """Wait for a launched step (the one device -> host copy) -> one result per scheduled request."""
        if step.results is not None:
            return step.results
        return self._results(step.batch.scheduled, self._copy_back(step.out) if step.out is not None else [])

    @torch.inference_mode()
    def _launch(self, batch: SchedulerOutput, layout: GraphLayout | None) -> torch.Tensor | None:
        """One step in one layout, a graph's or packed (``layout`` None), queued -> its device output: the
        sampled tokens [S] (None when no row samples)."""
        if layout is None:
            return self._decode(self.views(self.stage(batch)))
        # a replay reads the staged record in place: views are made only to capture
        rec, switches = self.stage_graph(batch, layout)
        return self.graphs.run(self.graph_key(layout, switches, rec), lambda: self._decode(self.graph_views(rec)[2]))

    def _results(self, sched: list[ScheduledRequest], values: list) -> list[RowResult]:
        """A step's copied-back output (``_launch``) -> one result per scheduled request."""
        tokens = iter(values)
        return [RowResult([next(tokens)] if s.sample else []) for s in sched]

    def _copy_back(self, out: torch.Tensor) -> list:
        """The step's one device -> host copy; it waits for the stream, so every upload has run too."""
        values = out.tolist()
        for st in self._staging_buffers():
            st.synced()
        return values

    def _decode(self, inp: StepInputs) -> torch.Tensor | None:
        """Target forward + sampling, all on the device -> tokens [S] (None when no row samples)."""
        inp.meta.new_step()
        hidden, _ = self.model(inp.input_ids, inp.positions, inp.meta, self.kv_views)
        if inp.sampling is None:
            return None
        # all greedy: only the argmax is read, in the weights' dtype (no float32 copy)
        logits_fn = self.model.lm_logits if inp.sampling.all_greedy else self.model.compute_logits
        rows = hidden if inp.logits_indices is None else hidden[inp.logits_indices]  # [S, H]
        return sample(logits_fn(rows), inp.sampling)  # logits [S, V]
