"""Automatic prefix caching: full KV blocks keyed by their tokens (and everything before them, and the tokens a draft
head's KV reads after them) are shared between requests. Outputs equal caching off, token for token (float32, CPU),
greedy and seeded, with and without speculation, chunked, preempted, under the overlap scheduler; blocks are counted
and evicted correctly."""

from __future__ import annotations

import pytest

from specserve import LLM, SamplingParams
from specserve.cache.kv_cache import BlockPool, block_keys
from specserve.runner.cuda_graph import CudaGraphs
from tiny_models import target_with_heads


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return target_with_heads(tmp_path_factory.mktemp("prefix"))


SPECS = {
    "no-spec": None,
    "eagle3-d3": dict(method="eagle3", draft_model="eagle3", max_draft_len=3),
    "mtp_eagle-d2": dict(method="mtp", draft_model="mtp", max_draft_len=2),
    "eagle3-tree": dict(method="eagle3", draft_model="eagle3", max_draft_len=3, topk=2, max_total_draft_tokens=6),
}

SYSTEM = [(11 * i + 5) % 300 + 1 for i in range(37)]  # a shared "system prompt": 2 full blocks of 16 and 5 more


def _prompts() -> list[list[int]]:
    """Requests over one system prompt with different questions, one repeated whole, one that diverges in the
    middle of the system prompt's second block, and a short one."""
    tails = [[7, 8, 9], [20, 21], [7, 8, 9], [40 + i for i in range(19)], [3]]
    out = [SYSTEM + t for t in tails]
    out.append(SYSTEM[:24] + [299, 298, 297])  # shares one full block, then diverges mid-block
    out.append([5, 6, 7])
    return out


def _params() -> list[SamplingParams]:
    return [SamplingParams(temperature=0, max_tokens=14, ignore_eos=True),
            SamplingParams(temperature=0.9, top_p=0.9, seed=3, max_tokens=11, ignore_eos=True)]


def _llm(dirs, spec: str, caching: bool, **kw) -> LLM:
    sc = None if SPECS[spec] is None else dict(SPECS[spec], draft_model=str(dirs / SPECS[spec]["draft_model"]))
    return LLM(str(dirs / "target"), device="cpu", dtype="float32", speculative_config=sc,
               enable_prefix_caching=caching, **kw)


def _run(llm: LLM, one_by_one: bool) -> list[list[int]]:
    """Every prompt, all at once or one request at a time (the later ones then find the earlier ones' blocks)."""
    prompts, params = _prompts(), _params()
    reqs = [{"prompt_token_ids": p} for p in prompts]
    ps = [params[i % 2] for i in range(len(prompts))]
    if one_by_one:
        return [llm.generate([r], p)[0].token_ids for r, p in zip(reqs, ps)]
    return [o.token_ids for o in llm.generate(reqs, ps)]


@pytest.mark.parametrize("spec", list(SPECS))
@pytest.mark.parametrize("kw", [{}, dict(max_num_batched_tokens=10), dict(block_size=4, num_kv_blocks=48)],
                         ids=["plain", "chunked", "preempting"])
def test_cached_prefixes_give_the_outputs_of_computed_ones(dirs, spec, kw):
    ref = _run(_llm(dirs, spec, False, **kw), one_by_one=True)
    llm = _llm(dirs, spec, True, **kw)
    assert _run(llm, one_by_one=True) == ref  # each request after the first finds the system prompt cached
    assert _run(llm, one_by_one=False) == ref  # and all at once, the whole run cached before
    pool = llm.engine.pool
    assert pool.hit > 0 and pool.num_free == pool.num_usable


def test_a_follow_up_turn_reuses_the_conversation(dirs):
    """A second turn is the first turn's prompt and reply plus more: its blocks were registered when the first
    request finished, so it computes only what is new."""
    llm = _llm(dirs, "eagle3-d3", True)
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    first = llm.generate([{"prompt_token_ids": SYSTEM}], greedy)[0].token_ids
    turn2 = SYSTEM + first + [17, 18, 19]
    out = llm.generate([{"prompt_token_ids": turn2}], greedy)[0]
    req_cached = llm.engine.pool.hit * 16
    assert req_cached >= (len(SYSTEM) + len(first)) // 16 * 16 - 16  # all but the block the reply ended in
    ref = _llm(dirs, "eagle3-d3", False).generate([{"prompt_token_ids": turn2}], greedy)[0]
    assert out.token_ids == ref.token_ids


def test_a_head_reads_the_token_after_a_block(dirs):
    """Two prompts equal for two blocks whose third-block first tokens differ: without a head the second finds both
    blocks; with a head (its KV at a block's last position reads the next token) only the first."""
    a = SYSTEM[:32] + [1, 2, 3]
    b = SYSTEM[:32] + [4, 5, 6]
    greedy = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    for spec, found in (("no-spec", 2), ("eagle3-d3", 1)):
        llm = _llm(dirs, spec, True)
        llm.generate([{"prompt_token_ids": a}], greedy)
        before = llm.engine.pool.hit
        llm.generate([{"prompt_token_ids": b}], greedy)
        assert llm.engine.pool.hit - before == found, spec


@pytest.mark.parametrize("spec", ["no-spec", "eagle3-d3", "eagle3-tree"])
def test_cached_prefixes_under_the_overlap_scheduler(dirs, spec):
    ref = _run(_llm(dirs, spec, False), one_by_one=False)
    llm = _llm(dirs, spec, True, overlap_scheduler=True, async_output=True)
    llm.engine.runner.graphs = CudaGraphs(8, llm.engine.runner._staging_buffers(), capture=False)
    assert _run(llm, one_by_one=True) == _run(_llm(dirs, spec, False), one_by_one=True)
    graphs = llm.engine.runner.graphs
    before = graphs.steps
    assert _run(llm, one_by_one=False) == ref
    assert llm.engine.pool.hit > 0 and graphs.steps > before  # the requests together ran graph layouts too


@pytest.mark.parametrize("spec", ["no-spec", "eagle3-d3"])
def test_requests_over_a_new_document_arriving_together_compute_it_once(dirs, spec):
    """Requests that arrive together over one document nobody has computed: the first computes it, the others
    wait for its blocks (a slot free) instead of computing them beside it, then find them cached; the outputs
    are those of caching off."""
    doc = [(7 * i + 3) % 290 + 1 for i in range(80)]  # five full blocks of 16
    reqs = [{"prompt_token_ids": doc + [200 + i, 201 + i]} for i in range(4)] + [{"prompt_token_ids": [9, 8, 7]}]
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    ref = [o.token_ids for o in _llm(dirs, spec, False).generate(reqs, greedy)]
    llm = _llm(dirs, spec, True)
    outs = llm.generate(reqs, greedy)
    assert [o.token_ids for o in outs] == ref
    full = 5 if spec == "no-spec" else 4  # with a head a block's key reads the token after it: the fifth differs
    assert llm.engine.pool.hit == 3 * full  # each later request found the whole document cached


def test_a_request_waits_for_the_prefix_another_is_computing():
    """The scheduler holds a waiting request whose first uncached block a running request is computing (its
    wait is counted from then, a slot being free), admits the others behind it, and admits it once the blocks
    are registered, starting after them."""
    from specserve.config import SchedulerConfig
    from specserve.core.request import Request
    from specserve.runner.model_runner import RowResult
    from specserve.scheduler.scheduler import Scheduler

    pool = BlockPool(32, 4, caching=True)
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=64), pool)
    sp = SamplingParams(temperature=0, max_tokens=4)
    doc = list(range(1, 13))  # three full blocks of 4
    a, b, c = (Request(r, None, p, sp, 1000, ()) for r, p in (("a", doc + [50]), ("b", doc + [60]), ("c", [7, 7])))
    for r in (a, b, c):
        s.add(r)
    out = s.schedule()
    assert [e.request.request_id for e in out.scheduled] == ["a", "c"] and list(s.waiting) == [b]
    assert b.metrics.first_scheduled_time is not None and not b.block_ids
    for e, res in s.update(out, [RowResult([99]) for _ in out.scheduled]):
        e.request.append_token(res.tokens[0])
        s.cache_blocks(e.request)
    out = s.schedule()
    first = {e.request.request_id: e for e in out.scheduled}
    assert set(first) == {"a", "b", "c"} and first["b"].start == 12 and pool.hit == 3

    # a held request holds a slot: with two slots, of three more requests over a new document one runs, one is
    # held (its wait counted from then) and the third waits for a slot, untimed and unvisited
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=2), BlockPool(32, 4, caching=True))
    doc = list(range(20, 32))
    reqs = [Request(f"r{i}", None, doc + [i], sp, 1000, ()) for i in range(3)]
    for r in reqs:
        s.add(r)
    assert [e.request for e in s.schedule().scheduled] == reqs[:1] and list(s.waiting) == reqs[1:]
    assert reqs[1].metrics.first_scheduled_time is not None and reqs[2].metrics.first_scheduled_time is None


def test_the_pool_shares_counts_and_evicts_the_least_recently_freed():
    pool = BlockPool(6, 4, caching=True)  # blocks 1..5
    a = []
    pool.reserve(a, 12)  # 3 blocks
    pool.register(a, [101, 102, 103])
    shared = pool.match([101, 102, 999])  # stops at the first key not found
    assert shared == a[:2] and pool.num_free == 2  # held twice now: not free
    pool.free(a)  # its third block: registered, nobody holds it -> evictable; the first two still held
    assert pool.num_free == 3
    pool.free(shared)
    assert pool.num_free == 5 and (pool.hit, pool.queried) == (2, 3)
    b = []
    pool.reserve(b, 8)  # the never-registered blocks go first: the cached content stays
    assert sorted(b) == [4, 5] and pool.match([101, 102, 103]) == [1, 2, 3]
    held = [1, 2, 3]
    pool.free(held)  # freed in reverse: 3, then 2, then 1
    c = []
    pool.reserve(c, 4)  # no plain free block left: the least recently freed cached one gives up its content
    assert c == [3] and pool.match([101, 102, 103]) == [1, 2]
    pool.register([4], [101])  # a key registered already keeps its block
    assert pool.match([101]) == [1]


def test_block_keys_chain_and_read_the_tokens_after():
    ids = list(range(40))
    plain = block_keys([], ids, 16, 0)
    assert len(plain) == 2  # two full blocks
    after = block_keys([], ids, 16, 1)
    assert len(after) == 2 and after != plain  # the token after a block is part of its key
    assert block_keys([], ids[:32], 16, 1) == after[:1]  # the second block's next token is not known yet
    other = block_keys([], [99] + ids[1:], 16, 0)
    assert other[0] != plain[0] and other[1] != plain[1]  # a block's key covers everything before it


def test_only_blocks_whose_kv_is_computed_are_registered():
    """A prompt of 40 tokens prefilled up to position 20: one full block is computed, the second is not yet (its
    tokens and their successor are known, its KV half written); only the first may be found by another request."""
    from specserve.config import SchedulerConfig
    from specserve.core.request import Request
    from specserve.scheduler.scheduler import Scheduler

    pool = BlockPool(10, 16, caching=True)
    sched = Scheduler(SchedulerConfig(), pool, key_after=1)
    req = Request("r", None, list(range(1, 41)), SamplingParams(max_tokens=4), 100, ())
    pool.reserve(req.block_ids, 40)
    req.num_computed_tokens = 20
    sched.cache_blocks(req)
    assert req.num_registered == 1
    keys = block_keys([], req.token_ids, 16, 1)
    assert pool.match(keys) == req.block_ids[:1]
    req.num_computed_tokens = 40
    sched.cache_blocks(req)
    assert req.num_registered == 2 and pool.match(keys) == req.block_ids[:2]
