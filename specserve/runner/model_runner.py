"""The model runner: a scheduled batch -> device step inputs -> target forward -> sampled tokens.

Host work per step: a CUDA-graph step (most steps on CUDA) writes a compact record per row and uploads it in
one copy, and the device expands it (``graph_inputs``, ``kernels.step_inputs``); a packed (eager) step builds
its integer arrays with numpy and uploads them in one copy (plus one for the float sampling parameters).
Staging buffers only ever grow; the sampled tokens come back in one copy at the end. Nothing in between
reads a device value.
"""

from __future__ import annotations

import operator
from typing import TYPE_CHECKING
from dataclasses import dataclass

import torch

from specserve.cache.kv_cache import KVCache
from specserve.config import cdiv
from specserve.kernels.step_inputs import correct_record, expand_record
from specserve.models.attention import AttentionMetadata, causal_prompts
from specserve.models.llama import LlamaForCausalLM
from specserve.runner.cuda_graph import CudaGraphs, GraphCheck, graph_check
from specserve.runner.graph_layout import PREFILL_PAD_SLACK, GraphKey, GraphLayout, prefill_q
from specserve.runner.graph_inputs import (Record, RestageState, record_views, restage_record, row_fields,
                                           stage_record)
from specserve.runner.overlap import CarryCopy, StepCarry, output_offsets, overlap_fields
from specserve.runner.packed import PackedSteps
from specserve.runner.sampler import LOGPROB_WIDTH, sample, sampling_columns, sampling_tensors, token_logprobs
from specserve.runner.staging import Staging
from specserve.runner.step_batch import RowResult, StepBatch, StepSwitches
from specserve.scheduler.scheduler import ScheduledRequest, SchedulerOutput

if TYPE_CHECKING:
    from specserve.speculative.speculator import Speculator

__all__ = ["Launched", "ModelRunner", "RowResult"]


@dataclass
class Launched:
    """A step queued on the device (``ModelRunner.launch``), to ``collect``."""

    batch: SchedulerOutput
    out: torch.Tensor | None  # its device output, copied back by ``collect``
    results: list[RowResult] | None = None  # already collected (a step run as several graph replays)
    carry: CarryCopy | None = None  # overlap scheduler: its result rows on their way to the host
    spec: Speculator | None = None  # the speculator it ran (None: a plain step, whose output is the sampled tokens)


@dataclass
class _LastRecord:
    """The last graph step's record, as ``stage_graph`` staged it in full."""

    layout: GraphLayout
    requests: list  # its rows' requests, in order (compared by identity)
    version: int  # the int staging buffer's version after it was written
    record: Record
    switches: StepSwitches
    ints: dict[str, list]  # its integer fields
    spec: Speculator | None  # the speculator its step ran (None: a plain step; a record of one is no other's)
    restaged: RestageState | None = None  # what the steps since have rewritten (``restage_record``)


class ModelRunner:
    """Runs one step: a scheduled batch -> a ``StepBatch`` (packed, or a graph's record expanded on the device) ->
    the target's forward pass -> sampling, or with a ``speculator`` verification, acceptance and drafting."""


    # a step that mixes generation rows with rows ending their prompts (requests joining running ones) whose one
    # prefill layout would pad too much runs at most this many of them each as its own graph, beside the generation
    # rows' graph
    max_split_prefills = 8

    def graph_layout(self, batch: SchedulerOutput) -> GraphLayout | None:
        """The CUDA-graph layout of a generation step (or of rows ending their prompts), or None to run eagerly. In a
        generation step every row samples after one known token, verifying its drafts (1 + D tokens per
        row; rows with fewer drafts, near their end, pad)."""
        shared = self._graph_shared(batch)
        if not isinstance(shared, tuple):
            return shared
        spec = self.speculator
        q = 1 if spec is None else spec.verify_q(max(s.num_drafts for s in batch.scheduled))
        return GraphLayout(shared[0], q, shared[1])

    def _graph_shared(self, batch: SchedulerOutput) -> tuple[int, int] | GraphLayout | None:
        """What every graph of this step shares, whatever it drafts: a generation step's (padded rows, table
        width), the prefill layout of rows that end their prompts, or None (no graph step)."""
        if self.graphs is None:
            return None
        width = self._generation_width(batch)
        if width is None:
            return self._prefill_layout(batch)
        rows = self.graphs.padded_rows(len(batch.scheduled))
        return None if rows is None else (rows, width)

    def _generation_width(self, batch: SchedulerOutput) -> int | None:
        """A generation step's table width (``_table_width``), or None where a row is no generation row. Inside
        ``launch`` computed once for its batch: the draft policy's graph check and the step's layout both ask, and
        each answer is two passes over every row (some 20 us at 128 rows on the host, before every step)."""
        memo = self._width_memo
        if memo is not None and memo[0] is batch:
            return memo[1]
        sched = batch.scheduled
        width = self._table_width(sched) if all(map(self._generation_row, sched)) else None
        if memo is not None:  # inside launch
            self._width_memo = (batch, width)
        return width

    @staticmethod
    def _generation_row(s: ScheduledRequest) -> bool:
        return s.sample and s.num_tokens - s.num_drafts == 1

    def _split(self, batch: SchedulerOutput) -> list[list[int]] | None:
        """Row groups of a step that no one graph fits (``graph_layout`` is None) but graphs do: the generation
        rows together, and the rows that end their prompts together in one prefill layout (or, where their
        padding would be too much, each alone); None to run the step as it is. Only with generation rows in
        the step: a step of prompts alone (a burst of arrivals) is one prefill layout or one packed step."""
        if self.graphs is None or len(batch.scheduled) < 2:
            return None
        gen, pre = [], []
        for i, s in enumerate(batch.scheduled):
            (gen if self._generation_row(s) else pre).append(i)
        if not gen or self.graphs.padded_rows(len(gen)) is None:
            return None
        groups = self._prefill_groups(batch, pre)
        return None if groups is None else [gen] + [rows for rows, _ in groups]

    def _prefill_groups(self, batch: SchedulerOutput, pre: list[int]) -> list[tuple[list[int], GraphLayout]] | None:
        """The rows ``pre`` of a step (each ending its prompt) as prefill graphs: one layout for all, else one per
        row (at most ``max_split_prefills``) -> (rows, layout) groups, or None where they fit no graphs."""
        together = self._prefill_layout(SchedulerOutput([batch.scheduled[i] for i in pre]))
        if together is not None:
            return [(pre, together)]
        if len(pre) > self.max_split_prefills:
            return None
        one = [self._prefill_layout(SchedulerOutput([batch.scheduled[i]])) for i in pre]
        return None if any(lay is None for lay in one) else [([i], lay) for i, lay in zip(pre, one)]

    def _prefill_layout(self, batch: SchedulerOutput) -> GraphLayout | None:
        """Rows that all end their prompts (they sample, none drafts, none is a generation row), each in at most
        ``prefill_graph_tokens`` tokens: a graph of ``prefill_q`` tokens a row (the longest row's), the padding
        tokens writing only the pad block. Several rows (a burst of arrivals, or prompts joining running requests)
        only where the padded layout holds at most twice their tokens plus ``PREFILL_PAD_SLACK``, or 16 a row: an
        eager step costs about one host launch per kernel, 14 ms for the default model on the GPU machine, more than
        that padding (on a large model the padding's compute would grow past it; the bound keeps it near the real
        tokens'). Such a layout, as any, is captured the first time a step needs it (about 0.1 s)."""
        sched = batch.scheduled
        # a generation row takes a generation layout (where the device corrects a row continuing the step in flight,
        # and a speculative row verifies and drafts as a generation row)
        if not sched or any(not s.sample or s.num_drafts or s.num_tokens > self.prefill_graph_tokens
                            or s.after is not None or self._generation_row(s) for s in sched):
            return None
        q = prefill_q(max(s.num_tokens for s in sched))
        if q > self.max_graph_q:
            return None
        if len(sched) > 1:
            rows = self.graphs.padded_rows(len(sched))
            if rows is None or rows * q > max(2 * batch.total_tokens + PREFILL_PAD_SLACK, 16 * rows):
                return None
        return self._layout(batch, q, prefill=True,
                            from_zero=self.causal_prompts and all(s.start == 0 for s in sched))

    def _layout(self, batch: SchedulerOutput, q: int, prefill: bool = False,
                from_zero: bool = False) -> GraphLayout | None:
        """Rows padded to a captured size; block tables as wide as the longest row needs, rounded up to a
        power of two (at least 256 tokens), so that a graph's attention covers at most twice the context
        it needs and a handful of graphs serve every context length."""
        rows = self.graphs.padded_rows(len(batch.scheduled))
        if rows is None:
            return None
        return GraphLayout(rows, q, self._table_width(batch.scheduled), prefill, from_zero)

    def _table_width(self, sched) -> int:
        # the longest row's blocks (one division: the host runs this for every step's rows)
        need = cdiv(max(s.start + s.num_tokens for s in sched) + self.table_lookahead, self.block_size)
        width = min(self.graph_table_width, 1 << max(need, cdiv(256, self.block_size)).bit_length() - 1)
        if width < need:
            width = min(self.graph_table_width, width * 2)
        return max(width, need)

    def _graph_check(self, batch: SchedulerOutput) -> GraphCheck:
        """For the draft policy's choice: which graphs of these rows exist (``cuda_graph.graph_check`` over
        ``_graph_shared``, computed at most once). A choice of 0 commits the steps after it to plain steps
        (``Speculator.drafts_nothing``; under the overlap scheduler the first of them still continues rows that
        verify drafts, in the speculator's graph of D = 0, captured where a layout first needs it)."""
        return graph_check(self.graphs, lambda: self._graph_shared(batch), self.speculator.graph_switches)

    def __init__(self, model: LlamaForCausalLM, kv_cache: KVCache, device: torch.device,
                 max_model_len: int | None = None, cuda_graph_max_rows: int = 0,
                 attention_backend: str = "auto", max_num_batched_tokens: int = 0,
                 capture_graphs: bool = True, speculator: Speculator | None = None, overlap: bool = False,
                 max_num_seqs: int = 1) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.kv_views = kv_cache.layer_views()[:model.config.num_hidden_layers]
        self.device = device
        self.block_size = kv_cache.block_size
        self.vocab_size = model.config.vocab_size
        self.sliding_window = model.config.sliding_window
        self.attention_backend = attention_backend
        self.causal_prompts = causal_prompts(attention_backend)  # prompts from 0 take their own kernel
        self.speculator = speculator
        spec = speculator
        # block-table entries past a row's tokens that a step may write (the draft loop's positions)
        self.table_lookahead = spec.lookahead_slots if spec is not None else 0
        self.generation_q = spec.verify_len if spec is not None else 1  # tokens per row of a generation step
        max_len = max_model_len or model.config.max_position_embeddings
        # padding tokens sit at positions up to a layout's q - 1: they must stay inside the RoPE table
        self.max_graph_q = min(max_len, model.config.max_position_embeddings)
        # rows ending their prompts in at most this many tokens each (batch-1 serving's prefill, up to the step's
        # token budget; a burst of arrivals) run as a prefill graph too
        self.prefill_graph_tokens = max(512, max_num_batched_tokens)
        self.graph_table_width = cdiv(max_len + 2 * self.table_lookahead + 1, self.block_size)
        rows = cuda_graph_max_rows if device.type == "cuda" else 0
        # staging sized for the largest graph step up front, so that graphs rarely need recapturing
        q = self.generation_q
        # overlap scheduler: the host stages a step while the device may not yet have copied the last one's inputs
        # (a step of several graph replays stages several records), so the host buffers are used in turn
        self.overlap = overlap
        ring = 4 if overlap else 1
        self._ints = Staging(torch.int64, device, max(rows * (4 * q + self.graph_table_width + 2 * q + 9),
                                                       6 * max_num_batched_tokens) * 2, ring=ring)
        self._floats = Staging(torch.float32, device, 8 * rows, ring=ring)
        width = spec.result_width if spec is not None else 1
        positions = spec.draft_len + 1 if spec is not None else 1  # tokens a row emits at most
        self.carry = StepCarry(max_num_seqs, width, positions * LOGPROB_WIDTH, device) if overlap else None
        # capture_graphs False (enforce_eager): the same padded layouts, run without capture, so that turning
        # graphs off changes nothing but the launches (on bf16 weights a GEMM's row count can pick its kernel)
        self.graphs = CudaGraphs(rows, self._staging_buffers(), capture=capture_graphs) if rows else None
        self._width_memo: tuple | None = None  # (batch, its generation table width) inside ``launch``
        self.packed = PackedSteps(self._ints, self._floats, self.block_size, self.table_lookahead, self.vocab_size,
                                  self.sliding_window, attention_backend, overlap, self.causal_prompts)
        self._last_record: _LastRecord | None = None

    @property
    def aux_layers(self) -> tuple[int, ...]:
        """Target layers whose output stream the draft head reads (none without speculation)."""
        return self.speculator.aux_layers if self.speculator is not None else ()

    def _staging_buffers(self) -> list[Staging]:
        return [self._ints, self._floats]

    # -- packed (eager) steps: the inputs built on the host ------------------------------------------------------
    def prepare(self, batch: SchedulerOutput, spec: Speculator | None = None) -> StepBatch:
        """Device inputs of a packed step (``runner/packed.py``); ``spec``: the speculator the step runs (None: a
        plain step)."""
        return self.packed.prepare(batch, spec)

    # -- graph steps: a compact record, expanded on the device ---------------------------------------------------
    def stage_graph(self, batch: SchedulerOutput, layout: GraphLayout,
                    spec: Speculator | None = None) -> tuple[Record, StepSwitches]:
        """Stage a graph step's compact record (``specserve.runner.graph_inputs``; ``spec``: the speculator the
        step runs, None for a plain step) -> (record, the host switches that pick the graph's variant). The
        record's upload is captured in the graph as a copy node, so a replay needs no copy call from the host (tens
        of µs a step on a slow host)."""
        sched = batch.scheduled
        b, q, m = layout.rows, layout.q, layout.table_width
        ints, tables = row_fields(sched, b, q, self.block_size, self.table_lookahead)
        reqs = [s.request for s in sched]
        if self.overlap:  # the host buffers are used in turn: each record is staged whole
            floats: dict[str, list[float]] = {}
            switches = self._record_params(sched, b, ints, floats, spec)
            ints["offsets"] = output_offsets(sched, b)
            ints.update(overlap_fields(sched, b, spec.draft_len if spec is not None else 0, self.carry.scratch,
                                       spec.num_nodes if spec is not None else 0))
            return stage_record(self._ints, sched, b, q, m, ints, tables, floats), switches
        last = self._last_record
        # the same requests in the same layout as the step before, nothing else staged since: their parameters are
        # in the buffer already, and only the fields that change per step are rewritten
        if (last is not None and last.layout == layout and last.version == self._ints.version and last.spec is spec
                and len(last.requests) == len(reqs) and all(map(operator.is_, last.requests, reqs))):
            ints.update(self._restaged_params(sched, b, last.ints, spec))
            last.restaged = restage_record(self._ints, last.record, ints, tables, last.restaged)
            # the step's drafting may differ from the last one's
            return last.record, last.switches if spec is None else spec.step_switches(last.switches)
        floats: dict[str, list[float]] = {}
        switches = self._record_params(sched, b, ints, floats, spec)
        rec = stage_record(self._ints, sched, b, q, m, ints, tables, floats)
        self._last_record = _LastRecord(layout, reqs, self._ints.version, rec, switches, ints, spec)
        return rec, switches

    def _record_params(self, sched, rows: int, ints: dict, floats: dict, spec: Speculator | None) -> StepSwitches:
        """Per-row parameters of a graph step (with ``spec``'s acceptance settings), added to ``ints`` / ``floats``
        -> the host switches."""
        reqs = [s.request for s in sched]
        si, sf = sampling_columns(reqs, rows, self.vocab_size)
        ints.update(si)
        floats.update(sf)
        switches = StepSwitches.of(reqs)
        if spec is not None:
            switches = spec.record_params(sched, rows, ints, floats, switches)
        return switches

    def _restaged_params(self, sched, rows: int, first: dict[str, list],
                         spec: Speculator | None) -> dict[str, list[int]]:
        """The per-row parameters of a graph step's record that change between steps of the same requests
        (``first``: the integer fields as the first of those steps staged them): each row's output index, which
        seeds its sampling, and speculating, whether it is in its thinking phase."""
        out = {"offsets": [s.request.num_output_tokens for s in sched] + [0] * (rows - len(sched))}
        if spec is not None:
            out.update(spec.restaged(sched, rows, first))
        return out

    @staticmethod
    def graph_key(layout: GraphLayout, switches: StepSwitches, rec: Record) -> GraphKey:
        return GraphKey(layout, switches, rec.size)

    def graph_batch(self, rec: Record, switches: StepSwitches, layout: GraphLayout, host_rows: list | None = None,
                    spec: Speculator | None = None) -> StepBatch:
        """Inside a graph step: the record's upload, its device views, what the device derives from them
        (``expand_record``) -> the step's inputs (``host_rows``: the scheduled rows, for test heads; ``spec``: the
        speculator the step runs, None for a plain step)."""
        if not self.overlap:
            self._ints.upload(rec.size)  # captured with the step
        f = record_views(self._ints, rec)
        b, q = rec.rows, rec.q
        if self.overlap and not layout.prefill:  # rows that continue the step in flight, from its results
            # a plain step of a speculative engine reads the token after the carry rows' accepted count (none)
            carry = self.carry.buf if spec is not None or self.speculator is None else self.carry.buf[:, 1:]
            correct_record(f, f["tokens"].view(b, q), carry, spec.draft_len if spec is not None else 0,
                           spec.thinking_tokens if spec is not None else (-1, -1),
                           spec.num_nodes if spec is not None and spec.tree else None)
        tables = f["tables"].view(b, rec.table_width)
        # a generation layout verifies its q - 1 drafts a row (a tree engine's layout of chains: the widest), a
        # prefill the most
        drafts = None if spec is None else spec.num_nodes if layout.prefill else q - 1
        more = {} if spec is None else dict(draft_len=drafts, flags=f["flags"].view(4, b))
        x = expand_record(f["start"], f["count"], f["num_drafts"], f["tokens"].view(b, q), tables, self.block_size,
                          **more)
        meta = AttentionMetadata(
            slot_mapping=x["slots"].view(-1), block_tables=tables, query_index=x["flat"], query_pos=x["positions"],
            flat_index=x["flat"].view(-1), sliding_window=self.sliding_window, backend=self.attention_backend,
            from_zero=layout.from_zero,
        )
        sampling = sampling_tensors(rec.requests, f)
        # every row of a graph step samples (padding rows as greedy dummies); with one token per row, row i's last
        # token is token i
        batch = StepBatch(input_ids=f["tokens"], positions=x["positions"].view(-1), meta=meta,
                          logits_indices=None if q == 1 else x["last"], sampling=sampling, result_rows=f.get("dst"))
        if spec is not None:
            batch.spec = spec.graph_inputs(f, x, sampling, switches, not layout.prefill, host_rows or [], meta)
        return batch

    # -- one step ------------------------------------------------------------------------------------------------
    def launch(self, batch: SchedulerOutput, draft_len: int | None = None) -> Launched:
        """Queue one step on the device and return without waiting for it (``collect`` waits). A step mixing
        generation rows with a few rows that end their prompts runs as several graph replays (``_split``): on
        the GPU machine that costs a few milliseconds where one eager step costs about 14; such a step is
        collected group by group here (two groups can replay one graph, whose output buffer the second rewrites).
        ``draft_len``: the drafts the step proposes, instead of the speculator's choice (step-cost measurements)."""
        self._width_memo = (None, None)  # ``_generation_width`` keeps its answer for this batch until the launch ends
        try:
            return self._plan_and_launch(batch, draft_len)
        finally:
            self._width_memo = None

    def _plan_and_launch(self, batch: SchedulerOutput, draft_len: int | None) -> Launched:
        spec = self.speculator
        if spec is not None:  # the drafts this step proposes (a tree or a chain; the draft length)
            most = spec.plan_step(batch.scheduled, draft_len, self._graph_check(batch))
            for s in batch.scheduled:
                s.next_drafts = most
            if spec.drafts_nothing(batch.scheduled):  # a plain step: the plain sampler, record and graph
                spec = None
        if self.overlap:
            return self._launch_overlap(batch, spec)
        layout = self.graph_layout(batch)
        groups = self._split(batch) if layout is None else None
        if groups is None:
            return Launched(batch, self._launch(batch, layout, spec), spec=spec)
        results: list[RowResult | None] = [None] * len(batch.scheduled)
        for rows in groups:  # rows are independent: each group's results equal the packed step's
            sub = SchedulerOutput([batch.scheduled[i] for i in rows])
            launched = Launched(sub, self._launch(sub, self.graph_layout(sub), spec), spec=spec)
            for i, res in zip(rows, self.collect(launched)):
                results[i] = res
        return Launched(batch, None, results, spec=spec)

    def collect(self, step: Launched) -> list[RowResult]:
        """Wait for a launched step (the one device -> host copy) -> one result per scheduled request."""
        if step.results is not None:
            return step.results
        sched = step.batch.scheduled
        if step.carry is not None:  # result rows by column
            rows, lps = StepCarry.read(step.carry)
            if step.spec is not None:
                return step.spec.results(sched, rows, lps)
            col = 0 if self.speculator is None else 1  # a speculative engine's rows: the accepted count (0) first
            return [RowResult([rows[i][col]], logprobs=None if lps is None else [lps[i][:LOGPROB_WIDTH]])
                    if s.sample else RowResult([]) for i, s in enumerate(sched)]
        out, lps = step.out if isinstance(step.out, tuple) else (step.out, None)
        values = self._copy_back(out) if out is not None else []
        lps = None if lps is None else lps.tolist()  # after the copy above: no wait of its own
        if step.spec is not None:
            return step.spec.results(sched, zip(*values), lps)
        tokens, rows = iter(values), iter(lps or [])
        return [RowResult([next(tokens)], logprobs=None if lps is None else [next(rows)]) if s.sample else
                RowResult([]) for s in sched]

    def can_overlap(self, running: int) -> bool:
        """Overlap scheduler: whether a step can be launched before the step in flight is collected, with at most
        ``running`` rows continuing it (they need a graph layout, where the device corrects them)."""
        return self.overlap and self.graphs is not None and self.graphs.padded_rows(running) is not None

    def overlap_groups(self, batch: SchedulerOutput) -> list[tuple[list[int], GraphLayout | None]] | None:
        """Overlap scheduler: a step's rows as (row indices, graph layout or None for packed) groups, the
        generation rows' group first (they read the step in flight's results, which the groups after it
        overwrite), or None when its generation rows fit no graph (the engine then collects the step in flight
        first: only a graph step corrects its rows on the device)."""
        every = list(range(len(batch.scheduled)))
        layout = self.graph_layout(batch)
        if layout is not None:
            return [(every, layout)]
        gen = [i for i in every if self._generation_row(batch.scheduled[i])]
        if gen and self.graphs is not None and self.graphs.padded_rows(len(gen)) is None:
            # more one-token rows than a graph takes (prompts found cached but for their last token join running
            # rows): the rows that continue the step in flight take the graph, the others run packed
            gen = [i for i in gen if batch.scheduled[i].after is not None]
        if self.graphs is None or (gen and self.graphs.padded_rows(len(gen)) is None):
            return None if any(batch.scheduled[i].after is not None for i in gen) else [(every, None)]
        pre = [i for i in every if i not in set(gen)]
        groups = [(gen, self.graph_layout(SchedulerOutput([batch.scheduled[i] for i in gen])))] if gen else []
        return groups + (self._prefill_groups(batch, pre) or [(pre, None)])

    def _launch_overlap(self, batch: SchedulerOutput, spec: Speculator | None) -> Launched:
        """Queue a step whose rows may continue the step in flight (``overlap_groups``); every group writes its
        result rows into the carry, which one copy brings back (``collect``)."""
        groups = self.overlap_groups(batch)
        if groups is None:
            raise RuntimeError("a step continuing the step in flight needs a graph layout (collect that step first)")
        for rows, layout in groups:
            sub = batch if len(rows) == len(batch.scheduled) else SchedulerOutput([batch.scheduled[i] for i in rows])
            self._launch(sub, layout, spec)
        asked = any(s.request.params.logprobs is not None for s in batch.scheduled)
        return Launched(batch, None, carry=self.carry.copy_back(len(batch.scheduled), logprobs=asked), spec=spec)

    @torch.inference_mode()
    def _launch(self, batch: SchedulerOutput, layout: GraphLayout | None,
                spec: Speculator | None) -> torch.Tensor | None:
        """One step in one layout, a graph's or packed (``layout`` None), with ``spec`` (the speculator, or None for
        a plain step), queued -> its device output (``step``)."""
        if layout is None:
            return self.step(self.prepare(batch, spec))
        # a replay reads the staged record in place: the step's inputs are built only to capture
        rec, switches = self.stage_graph(batch, layout, spec)
        if self.overlap:  # from the ring's host buffer: not a node of the graph
            self._ints.upload(rec.size)
        return self.graphs.run(self.graph_key(layout, switches, rec),
                               lambda: self.step(self.graph_batch(rec, switches, layout, batch.scheduled, spec)),
                               rerun=not self.overlap)

    def step(self, batch: StepBatch) -> torch.Tensor | None:
        """inputs -> target forward -> sample, or verify -> accept -> draft; all on the device -> the sampled
        tokens [S] (None when no row samples), or the speculator's result rows."""
        batch.meta.new_step()
        hidden, aux = self.model(batch.input_ids, batch.positions, batch.meta, self.kv_views,
                                 aux_layers=self.aux_layers if batch.spec is not None else ())
        if batch.spec is not None:
            out = self.speculator.step(self.model, batch, hidden, aux)
        elif batch.sampling is None:
            return None
        else:
            # all greedy: only the argmax is read, in the weights' dtype (no float32 copy)
            logits_fn = self.model.lm_logits if batch.sampling.all_greedy else self.model.compute_logits
            rows = hidden if batch.logits_indices is None else hidden[batch.logits_indices]  # [S, H]
            logits = logits_fn(rows)  # [S, V]
            out = sample(logits, batch.sampling)
            if batch.sampling.logprobs >= 0:  # some row asks for log-probabilities: [S, LOGPROB_WIDTH] beside
                out = (out, token_logprobs(logits, out, batch.sampling.logprobs))
        if batch.result_rows is not None:
            self.carry.publish(out, batch.result_rows)
        return out

    def _copy_back(self, out: torch.Tensor) -> list:
        """The step's one device -> host copy; it waits for the stream, so every upload has run too."""
        values = out.tolist()
        for st in self._staging_buffers():
            st.synced()
        return values
