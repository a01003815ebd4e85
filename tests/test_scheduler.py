"""Block pool and scheduler bookkeeping, without a model."""

from __future__ import annotations

import pytest

import torch

from specserve.cache import kv_cache
from specserve.cache.kv_cache import BlockPool, plan_num_blocks
from specserve.config import CacheConfig, SchedulerConfig
from specserve.core.request import Request
from specserve.sampling_params import SamplingParams
from specserve.runner.model_runner import RowResult
from specserve.scheduler.scheduler import Scheduler
from specserve.speculative.config import SpeculativeConfig


def apply(s: Scheduler, out, tokens: list[int]) -> None:
    """What the engine does after a plain step: advance lengths, append each sampling row's token."""
    it = iter(tokens)
    results = [RowResult([next(it)] if e.sample else []) for e in out.scheduled]
    for entry, res in s.update(out, results):
        entry.request.append_token(res.tokens[0])


def rows(out) -> list[tuple[str, int, int, bool]]:
    """A step's rows as (request id, start, tokens, samples)."""
    return [(x.request.request_id, x.start, x.num_tokens, x.sample) for x in out.scheduled]


def req(rid: str, n_prompt: int, max_tokens: int = 8) -> Request:
    return Request(rid, None, list(range(3, 3 + n_prompt)), SamplingParams(temperature=0, max_tokens=max_tokens),
                   10_000, ())


def test_pool_reserve_free_and_reserved_padding_block():
    pool = BlockPool(num_blocks=5, block_size=4)
    blocks: list[int] = []
    pool.reserve(blocks, 9)  # 3 blocks
    assert len(blocks) == 3 and 0 not in blocks and pool.num_free == 1
    pool.reserve(blocks, 12)  # still 3
    assert len(blocks) == 3
    assert not pool.can_reserve(blocks, 17)
    with pytest.raises(RuntimeError, match="exhausted"):
        pool.reserve(blocks, 17)
    assert not pool.try_reserve(blocks, 17) and len(blocks) == 3  # nothing taken when it does not fit
    assert pool.try_reserve(blocks, 16) and len(blocks) == 4 and pool.num_free == 0
    pool.free(blocks)
    assert blocks == [] and pool.num_free == 4


def test_chunked_prefill_and_decode_share_a_step():
    pool = BlockPool(64, 4)
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=10), pool)
    a, b = req("a", 3), req("b", 25)
    s.add(a)
    s.add(b)
    out = s.schedule()
    assert rows(out) == [("a", 0, 3, True), ("b", 0, 7, False)]
    apply(s, out, [100])
    out = s.schedule()  # a decodes one token; b continues its prompt with the rest of the budget
    assert rows(out) == [("a", 3, 1, True), ("b", 7, 9, False)]


def test_with_whole_prompts_together_only_a_steps_first_admission_starts_a_chunk():
    """(Set where steps run in CUDA-graph layouts.) A request that a step would cut beside another it admitted waits,
    taking nothing from the prefix cache; next step it is the first admitted and takes a chunk beside the decode."""
    pool = BlockPool(64, 4, caching=True)
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=10, whole_prompts_together=True), pool)
    first = req("first", 9)
    s.add(first)
    apply(s, s.schedule(), [100])  # its two full blocks are cached now
    s.cache_blocks(first)
    s.finish(first)
    a, b, c = req("a", 3), req("b", 25), req("c", 2)  # b begins with first's 9 tokens: 8 of them cached
    for r in (a, b, c):
        s.add(r)
    queried, hits = pool.queried, pool.hit
    out = s.schedule()  # b would be cut to 7 of its 17 uncached tokens beside a: it waits, and so does c behind it
    assert rows(out) == [("a", 0, 3, True)]
    assert not b.block_ids and b.num_computed_tokens == 0 and (pool.queried, pool.hit) == (queried, hits)
    apply(s, out, [101])
    out = s.schedule()  # a decodes one token; b takes its cached blocks and a chunk with the rest of the budget
    assert rows(out) == [("a", 3, 1, True), ("b", 8, 9, False)]
    assert pool.hit > hits
    # what fits after its cached blocks is whole, not cut: admitted beside another (15 tokens, 8 of them cached)
    s2 = Scheduler(SchedulerConfig(max_num_batched_tokens=10, whole_prompts_together=True), pool)
    d, e = req("d", 3), req("e", 15)
    s2.add(d)
    s2.add(e)
    out = s2.schedule()
    assert rows(out) == [("d", 0, 3, True), ("e", 8, 7, True)]


def test_lookahead_slots_are_reserved_for_sampling_requests():
    pool = BlockPool(64, 4)
    s = Scheduler(SchedulerConfig(num_lookahead_slots=5), pool)
    a = req("a", 8)
    s.add(a)
    s.schedule()
    assert len(a.block_ids) == 4  # 8 prompt + 5 lookahead slots -> 13 -> 4 blocks


def test_newest_request_is_preempted_and_requeued_first():
    pool = BlockPool(5, 4)  # 4 usable blocks = 16 slots
    s = Scheduler(SchedulerConfig(), pool)
    a, b = req("a", 8), req("b", 8)
    s.add(a)
    s.add(b)
    apply(s, s.schedule(), [1, 2])  # both prefilled: 8 tokens in 2 blocks each, pool full
    assert pool.num_free == 0
    out = s.schedule()  # a needs a 3rd block for token 9: b is preempted
    assert [x.request.request_id for x in out.scheduled] == ["a"]
    assert out.preempted == [b] and b.num_computed_tokens == 0 and b.block_ids == []
    assert s.waiting[0] is b and b.metrics.num_preemptions == 1
    s.finish(a)
    out = s.schedule()  # b recomputes prompt + its one output token, then samples
    assert rows(out) == [("b", 0, 9, True)]


def test_drafts_are_scheduled_for_verification_and_rejected_ones_dropped_by_length():
    pool = BlockPool(64, 4)
    s = Scheduler(SchedulerConfig(num_lookahead_slots=SpeculativeConfig(max_draft_len=3).lookahead_slots), pool)
    a = req("a", 5)
    s.add(a)
    out = s.schedule()
    for entry, _ in s.update(out, [RowResult([7], drafts=[8, 9, 10])]):
        entry.request.append_token(7)
    a.spec_token_ids = [8, 9, 10]
    out = s.schedule()
    e = out.scheduled[0]
    assert (e.start, e.num_tokens, e.num_drafts, e.sample) == (5, 4, 3, True)
    assert len(a.block_ids) == 3  # positions 5..8 verified + 2 draft-loop slots -> 11 slots
    s.update(out, [RowResult([8, 42], num_drafts=3, num_accepted=1)])
    assert a.num_computed_tokens == 7  # t=7 and the accepted draft 8; drafts 9, 10 rejected


def test_gpu_memory_utilization_is_a_share_of_total_memory_as_in_vllm(monkeypatch):
    gib = 2 ** 30
    free = {"v": 75 * gib}  # 80 GiB, of which the engine's 2 GiB of weights and 3 GiB elsewhere taken
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free["v"], 80 * gib))
    cuda = torch.device("cuda")
    per_block = gib // 64

    def plan(util, **kw):
        return plan_num_blocks(CacheConfig(gpu_memory_utilization=util, **kw), per_block, cuda, 2 * gib)

    # 0.9 of 80 GiB = 72 GiB for the engine: 72 - 2 (weights) - the activation reserve for the cache
    assert plan(0.9) == (72 * gib - 2 * gib - kv_cache.ACTIVATION_RESERVE) // per_block
    assert plan(0.5) == (40 * gib - 2 * gib - kv_cache.ACTIVATION_RESERVE) // per_block
    assert plan(0.9, kv_cache_memory_bytes=3 * per_block) == 3  # an explicit size wins over the share
    # memory PyTorch's allocator keeps cached for this process (a dropped engine's cache) is given back first
    free["v"] = 30 * gib
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: free.update(v=75 * gib))
    assert plan(0.9) == (72 * gib - 2 * gib - kv_cache.ACTIVATION_RESERVE) // per_block
    # other engines or processes hold memory the share asks for, or the share leaves nothing: clear errors
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    free["v"] = 30 * gib
    with pytest.raises(ValueError, match="only 32.0 GiB are free"):
        plan(0.9)
    with pytest.raises(ValueError, match="leaves no room for a KV cache"):
        plan(0.05)
