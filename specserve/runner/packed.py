"""Packed (eager) steps: a step's inputs built on the host with numpy, as named arrays laid out in the staging
buffers and uploaded in one copy each (``ArrayPack``). Steps that no CUDA graph layout fits run this way (a burst
of prompts, a non-final chunk, the CPU); a graph step stages a compact record instead (``graph_inputs``). Tests
check that both give the same tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from specserve.cache.kv_cache import PAD_BLOCK
from specserve.config import cdiv
from specserve.models.attention import AttentionMetadata
from specserve.runner.sampler import SAMPLING_FLOATS, SAMPLING_INTS, sampling_columns, sampling_tensors
from specserve.runner.staging import Staging
from specserve.runner.step_batch import ArrayPack, StepBatch, StepSwitches
from specserve.scheduler.scheduler import SchedulerOutput


@dataclass
class Staged:
    """A packed step's inputs once uploaded: its named arrays' layout in the staging buffers. Device views are
    made from this (``PackedSteps.views``)."""

    ints: ArrayPack  # in the int64 staging buffer (``PackedSteps.stage`` lists the arrays)
    floats: ArrayPack  # in the float32 one: sampling (and acceptance) parameters
    q: int  # tokens per row (the widest row)
    samplers: list  # the requests whose sampling parameters are staged, in row order
    switches: StepSwitches
    host_rows: list  # the scheduled rows (speculation's test heads read them)
    from_zero: bool = False  # every row's tokens start at position 0 (``AttentionMetadata.from_zero``)


class PackedSteps:
    """Builds a packed step's ``StepBatch`` in the runner's staging buffers; the speculator (chain or tree) adds
    its arrays (``packed_shapes``, ``stage_packed``, ``packed_inputs``)."""

    def __init__(self, ints: Staging, floats: Staging, block_size: int, lookahead: int, vocab_size: int,
                 sliding_window: int | None, attention_backend: str, overlap: bool, causal_prompts: bool) -> None:
        self.ints, self.floats = ints, floats
        self.block_size, self.lookahead, self.vocab_size = block_size, lookahead, vocab_size
        self.sliding_window, self.attention_backend = sliding_window, attention_backend
        self.causal_prompts = causal_prompts  # mark steps whose rows all start at 0 (``models.attention``)
        self.overlap = overlap  # each result row's carry column is staged too (``StepBatch.result_rows``)

    def prepare(self, batch: SchedulerOutput, spec) -> StepBatch:
        """Device inputs of a packed step (``stage`` then ``views``); ``spec``: the runner's speculator or None."""
        return self.views(self.stage(batch, spec), spec)

    def stage(self, batch: SchedulerOutput, spec) -> Staged:
        """Build a packed step's inputs on the host and upload them (a graph step stages a compact record
        instead, ``stage_graph``). Row i's tokens follow row i-1's, and the block tables are as wide as the
        longest row needs. Sampling parameters are staged for every sampling row; speculating, for every row
        (acceptance reads them by row)."""
        sched = batch.scheduled
        bs = self.block_size
        b = len(sched)
        q = max(s.num_tokens for s in sched)
        t = batch.total_tokens
        la = self.lookahead
        m = max(min(len(s.request.block_ids), cdiv(s.start + s.num_tokens + la, bs)) for s in sched)
        rows = [s for s in sched if s.sample or spec is not None]  # rows with results
        samplers = [s.request for s in rows]
        ns = len(samplers)
        shapes = dict(input_ids=(t,), positions=(t,), slots=(t,), flat=(t,), tables=(b, m), query_index=(b, q),
                      query_pos=(b, q), logits_indices=(0 if spec is not None else ns,),
                      **{k: (ns,) for k in SAMPLING_INTS})
        if self.overlap:
            shapes["result_rows"] = (ns,)
        fshapes = {k: (ns,) for k in SAMPLING_FLOATS}
        if spec is not None:
            more, fmore = spec.packed_shapes(b, q)
            shapes.update(more)
            fshapes.update(fmore)
        ipack, fpack = ArrayPack(shapes), ArrayPack(fshapes)
        a = ipack.views(self.ints.reserve(ipack.size))
        a["tables"][:] = PAD_BLOCK
        a["query_index"][:] = t  # padding queries read the zero row appended after the T real ones
        a["query_pos"][:] = 0
        # per row: its token ids and block-table row (Python lists); everything else is vectorised below
        starts = np.fromiter((s.start for s in sched), np.int64, b)
        counts = np.fromiter((s.num_tokens for s in sched), np.int64, b)
        first = np.cumsum(counts) - counts  # [B] packed offset of each row's first token
        tokens: list[int] = []
        for i, s in enumerate(sched):
            req = s.request
            known = s.num_tokens - s.num_drafts
            tokens += req.token_ids[s.start:s.start + known]
            tokens += req.spec_token_ids[:s.num_drafts]
            nb = min(len(req.block_ids), cdiv(s.start + s.num_tokens + la, bs))
            a["tables"][i, :nb] = req.block_ids[:nb]
        row = np.repeat(np.arange(b, dtype=np.int64), counts)  # [T] row of each token
        col = np.arange(t, dtype=np.int64) - first[row]  # [T] its index within the row
        p = starts[row] + col  # [T] its position
        a["input_ids"][:] = tokens
        a["positions"][:] = p
        a["slots"][:] = a["tables"][row, p // bs] * bs + p % bs
        a["flat"][:] = row * q + col
        a["query_index"][row, col] = np.arange(t, dtype=np.int64)
        a["query_pos"][row, col] = p
        f = fpack.views(self.floats.reserve(fpack.size))
        si, sf = sampling_columns(samplers, ns, self.vocab_size)
        for k, v in (*si.items(), *sf.items()):
            (a if k in si else f)[k][:] = v
        if self.overlap:
            a["result_rows"][:] = [s.column for s in rows]
        if spec is None and ns:  # each sampling row's last token
            a["logits_indices"][:] = (first + counts - 1)[np.fromiter((s.sample for s in sched), bool, b)]
        switches = StepSwitches.of(samplers)
        if spec is not None:
            switches = spec.stage_packed(sched, a, f, row, col, first, switches)
        self.ints.upload(ipack.size)
        if fpack.size:
            self.floats.upload(fpack.size)
        # SDPA's dense layout pads every row to the longest: a step that would pad past twice its tokens (one long
        # prompt beside many short ones) keeps the paged path, whose work and memory follow the real tokens
        from_zero = self.causal_prompts and not starts.any() and b * q <= 2 * t
        return Staged(ipack, fpack, q, samplers, switches, sched, from_zero=from_zero)

    def views(self, st: Staged, spec) -> StepBatch:
        """Device views of a staged packed step's inputs."""
        a = st.ints.views(self.ints.view(st.ints.size))
        f = st.floats.views(self.floats.view(st.floats.size))
        meta = AttentionMetadata(
            slot_mapping=a["slots"], block_tables=a["tables"], query_index=a["query_index"],
            query_pos=a["query_pos"], flat_index=a["flat"], sliding_window=self.sliding_window,
            backend=self.attention_backend, tree_bits=a.get("tree_bits"), tree_base=a.get("tree_base"),
            from_zero=st.from_zero,
        )
        sampling = sampling_tensors(st.samplers, {**a, **f}) if st.samplers else None
        batch = StepBatch(input_ids=a["input_ids"], positions=a["positions"], meta=meta,
                          logits_indices=a["logits_indices"], sampling=sampling, result_rows=a.get("result_rows"))
        if spec is not None:
            batch.spec = spec.packed_inputs(a, f, sampling, a["flat"], st.q, st.switches, st.host_rows)
        return batch
