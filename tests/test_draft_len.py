"""The draft length chosen per step (``speculative/draft_len.py``): greedy output equals plain decoding while D
changes between steps (0 included, every head kind, graph and packed layouts, the overlap scheduler, chunked
prefill, preemption); seeded sampling keeps the target's distribution (chi-square); the schedule, the gate and the
cost model's choice on synthetic costs and acceptance; step costs measured, saved and loaded."""

from __future__ import annotations

import json
import random
from collections import Counter
from types import SimpleNamespace

import numpy as np
import pytest

from specserve import LLM, SamplingParams, SpeculativeConfig
from specserve.core.metrics import SpecStats
from specserve.speculative.draft_len import (CAPTURE_GAIN, AcceptanceGate, DraftLenPolicy, StepCosts, best_draft_len,
                                             cost_buckets, engine_rates, expected_tokens, prefer_captured)
from accept_helpers import chi2_critical, chi2_homogeneity, make_small_vocab, sample_replies
from test_overlap import OracleHead, _llm
from tiny_models import PROMPTS, make_head, make_target_and_eagle3

GREEDY = SamplingParams(temperature=0, max_tokens=19, ignore_eos=True)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("draft_len")
    make_target_and_eagle3(root)
    make_head(root / "mtp1", root / "target", "mtp", num_modules=1, seed=2)
    make_head(root / "mtp3", root / "target", "mtp", num_modules=3, seed=3)
    return root


# a schedule that never binds makes the draft length vary (each step's layout as wide as its drafts); the tests
# then choose D at random per step
VARIES = dict(draft_len_schedule={64: 3})
SPECS = {
    "eagle3-oracle": dict(method="eagle3", draft_model="eagle3", max_draft_len=3, **VARIES),
    "mtp_eagle": dict(method="mtp", draft_model="mtp1", max_draft_len=3, **VARIES),
    # module k reads the tokens k + 1 ahead: drafting 3 after verifying none reads past the step's columns
    "mtp_vanilla": dict(method="mtp", draft_model="mtp3", max_draft_len=3, mtp_eagle=False, **VARIES),
}


@pytest.fixture(scope="module")
def reference(dirs):
    llm = LLM(str(dirs / "target"), device="cpu", dtype="float32")
    prompts = PROMPTS * 2
    outs = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    refs = {tuple(llm.tokenizer.encode(p)): llm.tokenizer.encode(p) + o for p, o in zip(prompts, outs)}
    return prompts, outs, refs


def _random_lengths(llm: LLM, seed: int) -> list[int]:
    """Each step drafts a D in 0..max_draft_len: a cycle through every value with jumps both ways (0 to the
    most, the most to 0), then random -> the choices, in order."""
    rng, chosen = random.Random(seed), []
    policy = llm.engine.draft_policy
    d = policy.max_draft_len
    first = [0, d, 1, d, 0, 0, d, d, 2 % (d + 1)]

    def choose(requests, generation=False, captured=None):
        chosen.append(first[len(chosen)] if len(chosen) < len(first) else rng.randint(0, d))
        return chosen[-1]

    policy.choose = choose
    return chosen


@pytest.mark.parametrize("spec", list(SPECS))
@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
@pytest.mark.parametrize("kw", [{}, dict(max_num_batched_tokens=12), dict(block_size=4, num_kv_blocks=40)],
                         ids=["plain", "chunked", "preempting"])
def test_greedy_output_is_plain_while_the_draft_length_changes(dirs, reference, spec, overlap, kw):
    prompts, ref, refs = reference
    sc = dict(SPECS[spec], draft_model=str(dirs / SPECS[spec]["draft_model"]))
    # graph layouts (run without capture on the CPU) with the overlap scheduler; packed steps without it
    llm = LLM(str(dirs / "target"), device="cpu", dtype="float32", speculative_config=sc, overlap_scheduler=overlap,
              **kw)
    keys = []
    if overlap:
        from specserve.runner.cuda_graph import CudaGraphs

        runner = llm.engine.runner
        runner.graphs = graphs = CudaGraphs(16, runner._staging_buffers(), capture=False)  # every batch size
        run = graphs.run
        graphs.run = lambda key, *a, **k: keys.append(key) or run(key, *a, **k)
    if spec == "eagle3-oracle":  # drafts that are right twice, then wrong: acceptance that D cuts
        head = OracleHead(refs, llm.engine.model_config.vocab_size, 2).bind(llm.engine.model)
        llm.engine.runner.speculator.drafter.head = head
    chosen = _random_lengths(llm, seed=len(spec) + overlap)
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == ref
    stats = llm.engine.spec_stats
    assert set(chosen) == {0, 1, 2, 3}
    # a generation graph verifies as many drafts as it drafts: one graph per D (D + 1 of them, not (D + 1)^2)
    gen = {(layout.rows, layout.q - 1, switches.draft_len) for layout, switches, _ in keys if not layout.prefill}
    assert all(v == d for _, v, d in gen) and len({d for _, _, d in gen}) > 1 if overlap else not keys
    assert sum(stats.steps_by_draft_len) == sum(n for _, n in stats.draft_len_history) > 0
    if spec == "eagle3-oracle":
        # right twice (but where the reply ends within two drafts): the third is never accepted
        assert stats.per_position[0] == 1.0 and stats.per_position[1] > 0.9 and stats.per_position[2] == 0.0
    assert llm.engine.pool.num_free == llm.engine.pool.num_usable


def test_the_overlap_scheduler_verifies_what_each_step_drafted(dirs, reference):
    """Under the overlap scheduler a row is staged before the step it continues is collected: it verifies the
    drafts that step proposed (its own D), which the host's rows, once rebased, agree with."""
    from test_overlap import _assert_device_rows_match_host

    prompts, ref, refs = reference
    llm = _llm(dirs, "eagle3-d3", True)
    head = OracleHead(refs, llm.engine.model_config.vocab_size, 3).bind(llm.engine.model)
    llm.engine.runner.speculator.drafter.head = head
    llm.engine.runner.speculator.policy.schedule = [(64, 3)]  # the draft length varies: layouts as wide as drafts
    _random_lengths(llm, seed=3)
    assert [o.token_ids for o in llm.generate(prompts[:5], GREEDY)] == ref[:5]
    _assert_device_rows_match_host(llm)
    assert llm.engine.runner.continued > 0


def test_sampled_acceptance_keeps_the_distribution_while_the_draft_length_changes(tmp_path_factory):
    """Tokens 2 and 3 of 3-token replies under plain sampling and speculation whose D is random per step: one
    distribution (chi-square)."""
    root = make_small_vocab(tmp_path_factory.mktemp("draft_len_sampled"))
    n = 3000
    plain, _ = sample_replies(root, None, n, [1, 2, 3], seed=500)
    got, stats = sample_replies(root, dict(max_draft_len=2, draft_len_schedule={4096: 2}), n, [1, 2, 3], seed=500,
                                setup=lambda llm: _random_lengths(llm, seed=9))
    assert stats.num_accepted > 0.1 * n and len(stats.steps_by_draft_len) == 3  # enough accepted to bite
    a = Counter(tuple(o.token_ids[1:3]) for o in plain)
    b = Counter(tuple(o.token_ids[1:3]) for o in got)
    stat, dof = chi2_homogeneity(a, b)
    assert stat < chi2_critical(dof), (stat, dof)


# -- the policies ------------------------------------------------------------------------------------------------

class _Req:
    def __init__(self, drafted, accepted):
        self.spec_stats = SpecStats(drafted_per_pos=list(drafted), accepted_per_pos=list(accepted))


def test_the_schedule_follows_tensorrt_llm():
    """{4: 4, 8: 2, 32: 1}: 1-4 rows draft 4, 5-8 two, 9-32 one, more none."""
    p = DraftLenPolicy(4, schedule={4: 4, 8: 2, 32: 1})
    assert [p.choose([_Req([], [])] * b) for b in (1, 4, 5, 8, 9, 32, 33, 100)] == [4, 4, 2, 2, 1, 1, 0, 0]
    # a schedule longer than max_draft_len is capped
    assert DraftLenPolicy(2, schedule={4: 4}).choose([_Req([], [])]) == 2


def test_the_gate_closes_on_a_low_rolling_acceptance_rate_and_stays_closed():
    gate = AcceptanceGate(window=3, threshold=0.5)
    p = DraftLenPolicy(3, gate=gate)
    def step(drafted, accepted):  # a collected step of two rows: the gate sums them
        p.observe([SimpleNamespace(num_drafts=drafted - drafted // 2, num_accepted=accepted - accepted // 2),
                   SimpleNamespace(num_drafts=drafted // 2, num_accepted=accepted // 2)])

    for drafted, accepted in ((3, 3), (3, 0), (0, 0), (3, 2)):  # 5 of 9 over the window: open
        step(drafted, accepted)
    assert not gate.closed and p.choose([_Req([], [])]) == 3
    step(3, 0)  # (3, 0), (3, 2), (3, 0): 2 of 9
    assert gate.closed and p.choose([_Req([], [])]) == 0
    for _ in range(5):
        step(3, 3)  # a closed gate draws nothing, so nothing reopens it
    assert p.choose([_Req([], [])]) == 0


def test_expected_tokens_blend_own_acceptance_with_the_engines():
    prior = SpecStats(drafted_per_pos=[10, 10], accepted_per_pos=[8, 4])
    # the engine's rates: its counts after 4 optimistic steps at the position before's rate (1.0 before the first)
    g0 = (8 + 4 * 1.0) / 14
    g1 = (4 + 4 * g0) / 14
    assert engine_rates(prior, 3) == pytest.approx([g0, g1, g1])  # position 3, never drafted: position 2's
    new = _Req([], [])  # nothing verified yet: the engine's rates
    assert expected_tokens([new.spec_stats], prior, 3) == pytest.approx([1, 1 + g0, 1 + g0 + g1, 1 + g0 + 2 * g1])
    # a request whose own drafts are never accepted, after 36 steps, outweighs the prior (weight 4)
    bad = _Req([36, 36, 36], [0, 0, 0])
    e = expected_tokens([bad.spec_stats], prior, 3)
    assert e[1] == pytest.approx(1 + 4 * g0 / 40) and e[3] < 1.2
    # rates never rise with depth; the batch sums its rows
    odd = _Req([10, 10], [2, 9])
    r = np.diff(expected_tokens([odd.spec_stats], prior, 2))
    assert r[1] <= r[0]
    assert expected_tokens([new.spec_stats, bad.spec_stats], prior, 3) == pytest.approx(
        expected_tokens([new.spec_stats], prior, 3) + e)
    assert list(expected_tokens([], prior, 3)) == [0, 0, 0, 0]


def test_a_few_unlucky_first_steps_do_not_stop_the_deep_drafts():
    """The lock-in this guards against: after three steps at D = 4 that accepted 2, 0 and 0 drafts, the engine's
    counts and the request's said positions 2-4 never accept, D = 1 won on batch-1 costs, and nothing drafted those
    positions again. Thin counts now stay near the optimistic prior, so D = 4 is still tried; many such steps do end it."""
    costs = StepCosts([1], [[0.49, 0.64, 0.65, 0.70, 0.69]])  # batch-1 step costs by D, default model on a GPU
    unlucky = SpecStats(drafted_per_pos=[3, 3, 3, 3], accepted_per_pos=[2, 0, 0, 0])
    p = DraftLenPolicy(4, adaptive=True, costs=costs, prior=lambda: unlucky)
    assert p.choose([_Req([3, 3, 3, 3], [2, 0, 0, 0])]) == 4
    many = SpecStats(drafted_per_pos=[300] * 4, accepted_per_pos=[200, 0, 0, 0])
    p = DraftLenPolicy(4, adaptive=True, costs=costs, prior=lambda: many)
    assert p.choose([_Req([300] * 4, [200, 0, 0, 0])]) == 1


def test_the_choice_maximises_tokens_per_second():
    tokens = np.array([1.0, 1.8, 2.3, 2.6, 2.8])
    cheap = [1.0, 1.05, 1.1, 1.15, 1.2]  # batch 1: verifying is nearly free, so the longest wins
    assert best_draft_len(tokens, cheap, 4) == 4
    dear = [1.0, 1.9, 2.8, 3.7, 4.6]  # every draft costs almost a step: none
    assert best_draft_len(tokens, dear, 4) == 0
    mid = [1.0, 1.2, 1.5, 2.0, 2.6]  # 1.5, 1.53, 1.3, 1.08 tokens per unit
    assert best_draft_len(tokens, mid, 4) == 2
    assert best_draft_len(tokens, cheap, 1) == 1  # the schedule's or gate's cap holds
    # the D of the step before stays unless another promises 2% more: D = 2's 1.513 against D = 1's 1.5 keeps 1
    near = [1.0, 1.2, 1.52, 2.0, 2.6]
    assert best_draft_len(tokens, near, 4) == 2
    assert best_draft_len(tokens, near, 4, current=1) == 1 and best_draft_len(tokens, near, 4, current=3) == 2
    assert best_draft_len(tokens, cheap, 2, current=4) == 2  # a current D past the cap gives way
    costs = StepCosts([1, 4, 16], [cheap, mid, dear])
    assert costs.row(1) == cheap and costs.row(3) == mid and costs.row(16) == dear
    assert costs.row(32) == pytest.approx([2 * t for t in dear])  # past the largest: grows with the rows
    p = DraftLenPolicy(4, adaptive=True, costs=costs, prior=lambda: SpecStats(
        drafted_per_pos=[100] * 4, accepted_per_pos=[80, 62, 48, 40]))
    assert [p.choose([_Req([], [])] * b) for b in (1, 3, 10)] == [4, 2, 0]


def _run_policy(policy: DraftLenPolicy, requests: list, period: list[float], steps: int, monkeypatch) -> list[int]:
    """``steps`` generation steps whose real seconds by D are ``period``, on a fake clock -> the D of each."""
    import types

    import specserve.speculative.draft_len as draft_len

    clock = [0.0]
    monkeypatch.setattr(draft_len, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    chosen = []
    for _ in range(steps):
        chosen.append(policy.choose(requests, generation=True))
        clock[0] += period[chosen[-1]]
    return chosen


def test_a_draft_length_without_a_graph_must_promise_more_than_a_capture_costs():
    """While another D has its graph for the step, a D without one (a capture mid-run, ~0.1 s on the GPU machine)
    is taken only where it promises CAPTURE_GAIN more tokens per second; with no graph at all the best D is taken."""
    tokens = np.array([1.0, 1.1, 1.2, 1.3])
    seconds = [1.0] * 4
    assert prefer_captured(tokens, seconds, 3, 3, lambda d: d == 3) == 3
    assert prefer_captured(tokens, seconds, 3, 3, lambda d: d == 1) == 1  # 1.3 < 1.1 * 1.25
    assert prefer_captured(tokens, seconds, 3, 3, lambda d: d in (0, 1, 2)) == 2
    assert prefer_captured(tokens, seconds, 3, 3, lambda d: d == 0) == 3  # 1.3 > 1.0 * (1 + CAPTURE_GAIN)
    assert 1.3 > 1.0 * (1 + CAPTURE_GAIN) > 1.3 / 1.1
    assert prefer_captured(tokens, seconds, 3, 3, lambda d: False) == 3
    assert prefer_captured(tokens, seconds, 2, 2, lambda d: d == 3) == 2  # past the cap: not a choice
    # through the policy: the measured costs' choice (D = 3) gives way to the captured D = 2
    costs = StepCosts([128], [[1.4e-3, 1.6e-3, 1.8e-3, 2.0e-3, 2.3e-3]])
    prior = SpecStats(drafted_per_pos=[1000] * 4, accepted_per_pos=[620, 410, 280, 220])
    rows = [_Req([], [])] * 100
    assert DraftLenPolicy(4, adaptive=True, costs=costs, prior=lambda: prior).choose(rows) == 3
    p = DraftLenPolicy(4, adaptive=True, costs=costs, prior=lambda: prior)
    assert p.choose(rows, captured=lambda d: d in (2, 4)) == 2


def test_observed_periods_correct_costs_measured_without_the_hosts_work(monkeypatch):
    """The case the H100 showed at 128 rows: start-up costs (graph replays) ranked D = 3 first, but the engine was
    host-bound and its real periods ranked D = 4 first (1.5x D = 3). Observed periods raise each D's estimate as it
    runs, a D not run keeps its lower one and is tried next, and the engine settles on D = 4."""
    measured = StepCosts([64, 128], [[1.0] * 5, [1.4e-3, 1.6e-3, 1.8e-3, 2.0e-3, 2.3e-3]])
    real = [2.86e-3, 5.3e-3, 3.4e-3, 5.1e-3, 3.2e-3]
    prior = SpecStats(drafted_per_pos=[1000] * 4, accepted_per_pos=[620, 410, 280, 220])
    rows = [_Req([], [])] * 100
    p = DraftLenPolicy(4, adaptive=True, costs=measured, prior=lambda: prior)
    assert p.choose(rows) == 3  # the measured costs' choice
    chosen = _run_policy(p, rows, real, 300, monkeypatch)
    assert set(chosen[:150]) == {1, 2, 3, 4}  # each tried once its estimate led (D = 0 never could)
    assert Counter(chosen[-100:])[4] == 100
    assert p.costs == measured and p.live.seconds[1][4] == pytest.approx(3.2e-3, rel=0.01)
    assert p.live.seconds[0] == [1.0] * 5  # other row counts untouched
    # under tensor parallelism ranks must choose alike, and their clocks differ: no periods observed
    tp = DraftLenPolicy(4, adaptive=True, costs=measured, prior=lambda: prior)
    tp.timed = False
    assert Counter(_run_policy(tp, rows, real, 100, monkeypatch)) == {3: 100} and tp.live == measured
    # a period past the estimate (a graph capture) moves it 12.5% at most; one 8x past it is no step's cost (the
    # engine waited for work) and is dropped
    c = StepCosts([1], [[1.0, 2.0]])
    c.observe(1, 1, 3.5)
    c.observe(1, 0, 0.5)
    c.observe(1, 0, 100.0)
    c.observe(2, 1, 100.0)  # past the largest bucket: not recorded
    assert c.seconds == [[0.875, 2.25]]


def test_a_period_is_recorded_only_between_two_alike_generation_steps(monkeypatch):
    """Under the overlap scheduler the period from one launch to the next mostly waits for the step before, so a
    period counts only where the last two steps were generation steps of the same rows and D; a prompt step's or
    a changed D's period is not recorded."""
    costs = StepCosts([4], [[1.0, 1.5]])
    p = DraftLenPolicy(1, adaptive=True, costs=costs, prior=lambda: SpecStats(
        drafted_per_pos=[100], accepted_per_pos=[90]))
    rows = [_Req([], [])] * 4
    import types

    import specserve.speculative.draft_len as draft_len

    clock = [0.0]
    monkeypatch.setattr(draft_len, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    for generation, dt in ((False, 5.0), (True, 2.5), (True, 2.5)):  # a prompt step, then two generation steps
        assert p.choose(rows, generation) == 1
        clock[0] += dt
    assert p.live.seconds == [[1.0, 1.5]]  # the periods after the prompt step and after the first generation step
    assert p.choose(rows, True) == 1  # the period after two alike generation steps: recorded
    assert p.live.seconds == [[1.0, 1.6875]]  # 2.5 clipped to 1.5x 1.5, a quarter of the way
    clock[0] += 2.5
    assert p.choose(rows[:3], True) == 1
    assert p.live.seconds == [[1.0, 1.890625]]
    clock[0] += 2.5
    p.choose(rows, True)  # the step before had 3 rows, the one before it 4: not recorded
    assert p.live.seconds == [[1.0, 1.890625]]


def test_a_batch_at_d0_probes_so_that_its_estimates_can_recover(monkeypatch):
    """A request whose first drafts were unlucky gets D = 0, and at D = 0 it verifies nothing: after
    ``PROBE_AFTER`` steps one step drafts (the best D > 0), then D = 0 again while the evidence holds, each probe
    that changed nothing doubling the wait (up to ``PROBE_MAX``); once drafting pays again the wait starts over. A
    probe keeps to a D whose step has its graph, where one has."""
    from specserve.speculative.draft_len import PROBE_AFTER, PROBE_MAX

    costs = StepCosts([1], [[0.49e-3, 0.64e-3, 0.65e-3, 0.70e-3, 0.69e-3]])
    prior = SpecStats(drafted_per_pos=[1000] * 4, accepted_per_pos=[620, 410, 280, 220])
    unlucky = _Req([60] * 4, [2, 0, 0, 0])
    p = DraftLenPolicy(4, adaptive=True, costs=costs, prior=lambda: prior)
    chosen = _run_policy(p, [unlucky], costs.seconds[0], 7 * PROBE_AFTER, monkeypatch)
    probes = [i for i, d in enumerate(chosen) if d]
    assert probes == [PROBE_AFTER - 1, 3 * PROBE_AFTER - 1, 7 * PROBE_AFTER - 1]
    assert {chosen[i] for i in probes} == {2}  # the most tokens a second of D > 0 on these costs
    assert p.probe_after == 8 * PROBE_AFTER <= PROBE_MAX
    lucky = _Req([60] * 4, [50, 40, 30, 25])  # what the probes found: drafting pays again
    assert p.choose([lucky], generation=True) == 4
    assert p.probe_after == PROBE_AFTER
    for _ in range(20):  # probes change nothing for long: the wait stops growing at PROBE_MAX
        p.zero_run = p.probe_after
        assert p.choose([unlucky], generation=True) > 0
    assert p.probe_after == PROBE_MAX
    # a probe takes the best D > 0 among those whose step has its graph, where one has; else the best
    p.zero_run = p.probe_after
    assert p.choose([unlucky], generation=True, captured=lambda d: d in (0, 3)) == 3
    p.zero_run = p.probe_after
    assert p.choose([unlucky], generation=True, captured=lambda d: d == 0) == 2
    tokens, seconds = p._expected_tokens([unlucky.spec_stats]), p.live.row(1)
    rate = {d: tokens[d] / seconds[d] for d in (1, 3, 4)}
    p.zero_run = p.probe_after
    assert p.choose([unlucky], generation=True, captured=lambda d: d in (1, 3, 4)) == max(rate, key=rate.get)
    assert len(set(rate.values())) == 3


def test_expected_tokens_are_reused_while_nothing_they_depend_on_changed(monkeypatch):
    """At D = 0 no request's counts change, so the policy reuses its last expected tokens; a changed row, or
    engine counts that moved (a request verified drafts), computes them again."""
    import specserve.speculative.draft_len as draft_len

    calls = []
    real = draft_len.expected_tokens
    monkeypatch.setattr(draft_len, "expected_tokens", lambda *a: calls.append(1) or real(*a))
    prior = SpecStats(drafted_per_pos=[1000] * 4, accepted_per_pos=[620, 410, 280, 220], num_verify_steps=250,
                      num_drafted=4000)
    rows = [_Req([60] * 4, [50, 40, 30, 25]), _Req([60] * 4, [2, 0, 0, 0])]
    p = DraftLenPolicy(4, adaptive=True, costs=StepCosts([2], [[1.0, 1.1, 1.2, 1.3, 1.4]]), prior=lambda: prior)
    p.timed = False  # the costs as given (no observed periods of these instant calls)
    first = p.choose(rows, True)
    assert p.choose(rows, True) == first and len(calls) == 1
    p.choose(rows[:1], True)  # another batch
    p.choose(rows[:1], True)
    assert len(calls) == 2
    p.choose([_Req([60] * 4, [50, 40, 30, 25])], True)  # as many rows, another request: its own counts
    assert len(calls) == 3
    p.choose(rows[:1], True)
    assert len(calls) == 4
    rows[0].spec_stats.accepted_per_pos = [0, 0, 0, 0]  # as a verify step records it, with the engine's counts
    prior.num_verify_steps += 1
    assert p.choose(rows[:1], True) == 0 and len(calls) == 5


def test_step_costs_are_checked_saved_and_loaded(tmp_path):
    f = tmp_path / "costs.json"
    a = StepCosts([1, 2], [[1.0, 2.0], [1.5, 2.5]])
    a.save(f, "model-a")
    StepCosts([1], [[3.0, 4.0]]).save(f, "model-b")
    assert StepCosts.load(f, "model-a") == a and StepCosts.load(f, "model-b").seconds == [[3.0, 4.0]]
    assert StepCosts.load(f, "other") is None and StepCosts.load(tmp_path / "none.json", "model-a") is None
    f.write_text(json.dumps({"model-a": {"buckets": [1]}}))
    with pytest.raises(ValueError, match="not one written by specserve"):
        StepCosts.load(f, "model-a")
    for buckets, seconds in (([2, 1], [[1.0], [1.0]]), ([1], [[1.0], [2.0]]), ([1, 2], [[1.0], [1.0, 2.0]]),
                             ([1], [[0.0]])):
        with pytest.raises(ValueError, match="step costs"):
            StepCosts(buckets, seconds)
    assert cost_buckets(1) == [1] and cost_buckets(6) == [1, 2, 4, 6] and cost_buckets(8) == [1, 2, 4, 8]


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_adaptive_engine_measures_saves_and_reloads_its_costs(dirs, reference, tmp_path, monkeypatch, overlap):
    """An adaptive engine measures a step of each (batch bucket, D) at start (under the overlap scheduler each
    step launched before the one before is collected) and writes them to its cost file; the next engine reads
    them instead of measuring; outputs stay plain greedy's and the blocks the measurement took go back to the
    pool."""
    import specserve.speculative.draft_len as draft_len

    prompts, ref, refs = reference
    f = tmp_path / "costs.json"
    sc = dict(SPECS["eagle3-oracle"], draft_model=str(dirs / "eagle3"), adaptive_draft_len=True,
              step_cost_file=str(f))
    llm = LLM(str(dirs / "target"), device="cpu", dtype="float32", speculative_config=sc, max_num_seqs=4,
              overlap_scheduler=overlap)
    costs = llm.engine.draft_policy.costs
    assert costs.buckets == [1, 2, 4] and costs.max_draft_len == 3
    assert llm.engine.pool.num_free == llm.engine.pool.num_usable
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == ref
    saved = json.loads(f.read_text())
    assert len(saved) == 1 and next(iter(saved.values()))["buckets"] == [1, 2, 4]

    def no_measuring(*a, **k):
        raise AssertionError("measured again")

    monkeypatch.setattr(draft_len, "measure_step_costs", no_measuring)
    again = LLM(str(dirs / "target"), device="cpu", dtype="float32", speculative_config=sc, max_num_seqs=4)
    assert again.engine.draft_policy.costs == costs


def test_a_head_that_never_accepts_stops_drafting(dirs, reference):
    """With costs where drafting pays only if drafts are accepted, a head that never is right is soon given D = 0
    (its requests' own counts outweigh the prior); an oracle head keeps the longest D."""
    prompts, ref, refs = reference
    sc = dict(SPECS["eagle3-oracle"], draft_model=str(dirs / "eagle3"), adaptive_draft_len=True)
    for right, expect in ((0, 0), (3, 3)):
        llm = LLM(str(dirs / "target"), device="cpu", dtype="float32", speculative_config=sc, max_num_seqs=8)
        llm.engine.draft_policy.costs = StepCosts([8], [[1.0, 1.3, 1.6, 1.9]])
        head = OracleHead(refs, llm.engine.model_config.vocab_size, right).bind(llm.engine.model)
        llm.engine.runner.speculator.drafter.head = head
        assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == ref
        last = llm.engine.spec_stats.draft_len_history[-1]
        assert last[0] == expect, llm.engine.spec_stats.draft_len_history


def test_the_engine_keeps_to_draft_lengths_whose_graphs_exist(dirs, reference, monkeypatch):
    """The runner tells the policy which D have their step's graph (without capture, as here and under
    enforce_eager, the layouts run: the same choices as with capture): with a capture made to cost more than any
    gain, every step where some D has one takes such a D; greedy outputs are plain's."""
    import specserve.speculative.draft_len as draft_len
    from specserve.runner.cuda_graph import CudaGraphs

    prompts, ref, refs = reference
    monkeypatch.setattr(draft_len, "CAPTURE_GAIN", 1e9)
    sc = dict(SPECS["eagle3-oracle"], draft_model=str(dirs / "eagle3"), adaptive_draft_len=True)
    llm = LLM(str(dirs / "target"), device="cpu", dtype="float32", speculative_config=sc, max_num_seqs=8)
    runner = llm.engine.runner
    runner.graphs = CudaGraphs(8, runner._staging_buffers(), capture=False)  # has(): the layouts run
    policy = llm.engine.draft_policy
    policy.costs = StepCosts([8], [[1.0, 1.1, 1.2, 1.3]])  # the oracle's 2 right drafts: D = 2 the best
    policy.timed = False  # the estimates stay as set (no periods observed)
    llm.engine.runner.speculator.drafter.head = OracleHead(refs, llm.engine.model_config.vocab_size, 2).bind(
        llm.engine.model)
    calls, choose = [], policy.choose

    def spy(requests, generation=False, captured=None):
        if len(calls) == 6:  # now D = 1 is the best by far, but its steps' layouts have no graphs
            policy.live = StepCosts([8], [[1.0, 1.0, 5.0, 5.0]])
        d = choose(requests, generation, captured)
        if captured is not None:
            calls.append((d, [captured(k) for k in range(policy.max_draft_len + 1)]))
        return d

    policy.choose = spy
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == ref
    assert len(calls) > 10 and all(have[d] for d, have in calls if any(have))
    # steps where the best, D = 1, had no graph and another D had one (which they took)
    assert any(not have[1] and any(have) for _, have in calls[7:])


def test_draft_length_settings_are_checked():
    ok = SpeculativeConfig(draft_model="random", max_draft_len=4, draft_len_schedule={"4": 4, "8": 2})
    assert ok.draft_len_schedule == {4: 4, 8: 2} and ok.varies_draft_len
    assert not SpeculativeConfig(draft_model="random").varies_draft_len
    for bad, match in ((dict(draft_len_schedule={4: 5}), "draft lengths"), (dict(draft_len_schedule={}), "non-empty"),
                       (dict(draft_len_schedule={"x": 1}), "integer"), (dict(draft_len_schedule={0: 1}), ">= 1"),
                       (dict(acceptance_rate_window_size=8), "both"),
                       (dict(acceptance_rate_window_size=0, acceptance_rate_threshold=0.5), ">= 1"),
                       (dict(acceptance_rate_window_size=8, acceptance_rate_threshold=1.5), r"\[0, 1\]"),
                       (dict(step_cost_file="c.json"), "adaptive_draft_len=True"),
                       (dict(topk=2, adaptive_draft_len=True), "chains")):
        with pytest.raises(ValueError, match=match):
            SpeculativeConfig(draft_model="random", max_draft_len=4, **bad)


def test_cli_flags_reach_the_speculative_config(dirs):
    from specserve.cli import build_parser, engine_args

    a = build_parser().parse_args(["generate", "x", "--model", str(dirs / "target"), "--draft", str(dirs / "eagle3"),
                                   "--draft-len-schedule", "4:4,8:2,32:1", "--acceptance-rate-window-size", "16",
                                   "--acceptance-rate-threshold", "0.3", "--adaptive-draft-len",
                                   "--step-cost-file", "c.json"])
    spec = SpeculativeConfig.from_value(engine_args(a).speculative_config)
    assert (spec.draft_len_schedule, spec.acceptance_rate_window_size, spec.acceptance_rate_threshold,
            spec.adaptive_draft_len, spec.step_cost_file) == ({4: 4, 8: 2, 32: 1}, 16, 0.3, True, "c.json")
    a = build_parser().parse_args(["generate", "x", "--model", str(dirs / "target"), "--draft", str(dirs / "eagle3"),
                                   "--topk", "2", "--tree-max-batch-size", "16"])
    spec = SpeculativeConfig.from_value(engine_args(a).speculative_config)
    assert (spec.topk, spec.tree_max_batch_size, spec.measures_tree_costs) == (2, 16, False)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "x", "--draft-len-schedule", "4-4"])
    with pytest.raises(ValueError, match="--adaptive-draft-len set but speculation is off"):
        engine_args(build_parser().parse_args(["generate", "x", "--no-spec", "--adaptive-draft-len"]))
