"""The model runner: a scheduled batch -> device step inputs -> target forward -> sampled tokens.

Host work per step is building a few integer arrays with numpy; they travel to the device in one copy
(plus one for the float sampling parameters) into staging buffers that only ever grow, and the
sampled tokens come back in one copy at the end. Nothing in between reads a device value.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from specserve.cache.kv_cache import KVCache, PAD_BLOCK
from specserve.config import cdiv
from specserve.models.attention import AttentionMetadata, build_mask
from specserve.models.llama import LlamaForCausalLM
from specserve.runner.sampler import SamplingTensors, sample
from specserve.scheduler.scheduler import SchedulerOutput


def sampling_row(req, vocab_size: int) -> tuple[tuple[int, int, int], tuple[float, float, float]]:
    """One request's sampling parameters as host values: (top_k, seed, output index), (temperature, top_p, min_p)."""
    sp = req.params
    return ((sp.top_k if sp.top_k > 0 else vocab_size, req.seed, req.num_output_tokens),
            (sp.temperature, sp.top_p, sp.min_p))


def sampling_tensors(reqs, ints: list[torch.Tensor], floats: torch.Tensor) -> SamplingTensors:
    """ints = [top_k, seeds, offsets] device views [S]; floats = [temperature; top_p; min_p] device [3S]."""
    n = len(reqs)
    return SamplingTensors(
        temperature=floats[:n], top_p=floats[n:2 * n], min_p=floats[2 * n:3 * n], top_k=ints[0], seeds=ints[1],
        offsets=ints[2], all_greedy=all(r.params.greedy for r in reqs),
        needs_filter=any(r.params.needs_filter for r in reqs),
    )


class _Staging:
    """A pinned host buffer and its device twin; ``upload(n)`` copies the first n elements."""

    def __init__(self, dtype: torch.dtype, device: torch.device) -> None:
        self.dtype, self.device = dtype, device
        self.host = torch.empty(0, dtype=dtype)
        self.dev = torch.empty(0, dtype=dtype, device=device)

    def reserve(self, n: int) -> np.ndarray:
        if n > self.host.numel():
            size = max(n, 2 * self.host.numel(), 1024)
            pin = self.device.type == "cuda"
            self.host = torch.empty(size, dtype=self.dtype, pin_memory=pin)
            self.dev = torch.empty(size, dtype=self.dtype, device=self.device)
        return self.host.numpy()

    def upload(self, n: int) -> torch.Tensor:
        if self.device.type == "cpu":
            return self.host[:n]
        self.dev[:n].copy_(self.host[:n], non_blocking=True)
        return self.dev[:n]


@dataclass
class RowResult:
    """What one scheduled request got from a step."""

    tokens: list[int]  # emitted tokens, in order (empty when the row does not sample)
    drafts: list[int] = field(default_factory=list)  # drafts to verify next step
    num_drafts: int = 0  # drafts verified this step
    num_accepted: int = 0  # of those, accepted


@dataclass
class StepInputs:
    """One step's device inputs (views into the staging buffers)."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # [S] int64: flat index of each sampling request's last token
    sampling: SamplingTensors | None  # None when no request samples this step


class ModelRunner:
    # block-table entries beyond a row's tokens that the step may write (the draft loop's positions)
    table_lookahead = 0

    def __init__(self, model: LlamaForCausalLM, kv_cache: KVCache, device: torch.device) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.kv_views = kv_cache.layer_views()[:model.config.num_hidden_layers]
        self.device = device
        self.block_size = kv_cache.block_size
        self.vocab_size = model.config.vocab_size
        self.sliding_window = model.config.sliding_window
        self._ints = _Staging(torch.int64, device)
        self._floats = _Staging(torch.float32, device)

    def prepare(self, batch: SchedulerOutput, with_sampling: bool = True) -> StepInputs:
        """Device inputs of a step; ``with_sampling=False`` leaves out the per-row sampling parameters
        (the speculative runner builds its own, for every row)."""
        sched = batch.scheduled
        bs = self.block_size
        b = len(sched)
        t = batch.total_tokens
        q = max(s.num_tokens for s in sched)
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
        t0 = 0
        for i, s in enumerate(sched):
            req, n = s.request, s.num_tokens
            blocks = np.asarray(req.block_ids, dtype=np.int64)
            p = np.arange(s.start, s.start + n, dtype=np.int64)
            known = n - s.num_drafts
            ids[t0:t0 + known] = req.token_ids[s.start:s.start + known]
            ids[t0 + known:t0 + n] = req.spec_token_ids[:s.num_drafts]
            pos[t0:t0 + n] = p
            slots[t0:t0 + n] = blocks[p // bs] * bs + p % bs
            flat[t0:t0 + n] = i * q + np.arange(n)
            nb = min(len(blocks), cdiv(s.start + n + la, bs))
            tables2[i, :nb] = blocks[:nb]
            qidx2[i, :n] = np.arange(t0, t0 + n)
            qpos2[i, :n] = p
            t0 += n
        fbuf = self._floats.reserve(3 * ns) if ns else None
        for j, s in enumerate(samplers):
            (topk[j], seeds[j], offsets[j]), (fbuf[j], fbuf[ns + j], fbuf[2 * ns + j]) = \
                sampling_row(s.request, self.vocab_size)
        ends = np.cumsum([s.num_tokens for s in sched]) - 1  # last flat token of each request
        lidx[:] = [ends[i] for i, s in enumerate(sched) if s.sample and with_sampling]

        dev = self._ints.upload(int(offs[-1]))
        d = [dev[offs[i]:offs[i + 1]] for i in range(len(sizes))]
        query_pos = d[6].view(b, q)
        meta = AttentionMetadata(
            slot_mapping=d[2], block_tables=d[4].view(b, m), query_index=d[5].view(b, q), flat_index=d[3],
            mask=build_mask(query_pos, m * bs, self.sliding_window),
        )
        sampling = None
        if ns:
            sampling = sampling_tensors([s.request for s in samplers], d[8:11], self._floats.upload(3 * ns))
        return StepInputs(input_ids=d[0], positions=d[1], meta=meta, logits_indices=d[7], sampling=sampling)

    @torch.inference_mode()
    def execute(self, batch: SchedulerOutput) -> list[RowResult]:
        """Run one step; returns one result per scheduled request, in schedule order."""
        inp = self.prepare(batch)
        hidden, _ = self.model(inp.input_ids, inp.positions, inp.meta, self.kv_views)
        tokens = iter([])
        if inp.sampling is not None:
            logits = self.model.compute_logits(hidden[inp.logits_indices])  # [S, V]
            tokens = iter(sample(logits, inp.sampling).tolist())  # the step's one device -> host copy
        return [RowResult([next(tokens)] if s.sample else []) for s in batch.scheduled]
