"""The draft-length policies on synthetic costs and acceptance (``speculative/draft_len.py``): TensorRT-LLM's
schedule and gate, expected tokens, the adaptive choice (captured graphs, observed periods, probes, reuse of its
expected tokens), and step costs checked, saved and loaded. The engine under a changing draft length:
``test_draft_len.py``."""

from __future__ import annotations

import json
import math
from collections import Counter

import numpy as np
import pytest

from specserve.core.metrics import SpecStats, Tally, Verified
from specserve.runner.cuda_graph import GraphCheck
from specserve.speculative.draft_len import (CAPTURE_SECONDS, AcceptanceGate, DraftLenPolicy, best_draft_len,
                                             engine_rates, expected_tokens, prefer_captured)
from specserve.speculative.step_costs import StepCosts, cost_buckets


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
    def step(drafted, accepted):  # a collected step of two rows, tallied as the engine does: the gate sums them
        rows = [(drafted - drafted // 2, accepted - accepted // 2), (drafted // 2, accepted // 2)]
        p.observe(Tally(Verified(d, a, a + 1) for d, a in rows if d > 0))

    for drafted, accepted in ((3, 3), (3, 0), (0, 0), (3, 2)):  # 5 of 9 over the window: open
        step(drafted, accepted)
    assert not gate.closed and p.choose([_Req([], [])]) == 3
    step(3, 0)  # (3, 0), (3, 2), (3, 0): 2 of 9
    assert gate.closed and p.choose([_Req([], [])]) == 0
    for _ in range(5):
        step(3, 3)  # a closed gate draws nothing, so nothing reopens it
    assert p.choose([_Req([], [])]) == 0
    # the policy counted every row that verified drafts (the prior of the adaptive rule)
    assert (p.counts.num_drafted, p.counts.num_accepted) == (3 + 3 + 3 + 3 + 15, 3 + 2 + 15)


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


def test_no_drafting_is_never_rented_against():
    """D = 0's steps are plain steps, whose graph a plain engine captures wherever it runs: where D = 0 is the best
    (a head that accepts nothing) it is taken at once, its graph captured or not; where another D is the best, D =
    0 is rented only where its graph exists."""
    costs = StepCosts([1], [[0.5e-3, 0.6e-3, 0.62e-3, 0.64e-3, 0.66e-3]])
    p = DraftLenPolicy(4, adaptive=True, costs=costs, prior=lambda: SpecStats(
        drafted_per_pos=[1000] * 4, accepted_per_pos=[0] * 4))
    p.timed = False
    assert p.choose([_Req([], [])], generation=True, captured=GraphCheck(lambda d: d == 4)) == 0
    assert not p.rent.owed
    good = DraftLenPolicy(4, adaptive=True, costs=costs, prior=lambda: SpecStats(
        drafted_per_pos=[1000] * 4, accepted_per_pos=[900, 800, 700, 600]))
    good.timed = False
    assert good.choose([_Req([], [])], generation=True, captured=GraphCheck(lambda d: False)) == 4  # none at all
    assert good.choose([_Req([], [])], generation=True, captured=GraphCheck(lambda d: d == 1)) == 1  # rented
    assert good.choose([_Req([], [])], generation=True, captured=GraphCheck(lambda d: d == 0)) == 0


def test_a_draft_length_without_a_graph_is_rented_until_the_rent_would_have_paid_its_capture():
    """While another D has its graph for the step, the best D without one (a capture mid-run, ~0.1 s on the GPU
    machine) is not taken: the best D with a graph is, and what that loses against the best accrues until it reaches
    CAPTURE_SECONDS; then the best D is taken (captured). With no graph at all the best D is taken at once."""
    tokens = np.array([1.0, 1.1, 1.2, 1.3])
    seconds = [1e-3] * 4
    assert prefer_captured(tokens, seconds, 3, 3, lambda d: d == 3) == (3, 0.0)
    d, lost = prefer_captured(tokens, seconds, 3, 3, lambda d: d == 1)
    assert d == 1 and lost == pytest.approx(1e-3 * (1 - 1.1 / 1.3))
    assert prefer_captured(tokens, seconds, 3, 3, lambda d: d == 1, owed=CAPTURE_SECONDS - lost / 2) == (3, 0.0)
    assert prefer_captured(tokens, seconds, 3, 3, lambda d: d == 1, owed=CAPTURE_SECONDS - 2 * lost)[0] == 1
    assert prefer_captured(tokens, seconds, 3, 3, lambda d: d in (0, 1, 2))[0] == 2
    assert prefer_captured(tokens, seconds, 3, 3, lambda d: False) == (3, 0.0)
    assert prefer_captured(tokens, seconds, 2, 2, lambda d: d == 3) == (2, 0.0)  # past the cap: not a choice
    # through the policy: the measured costs' choice (D = 3) gives way to the captured D = 2 until the seconds that
    # loses reach a capture's, counted per (rows, D)
    costs = StepCosts([128], [[1.4e-3, 1.6e-3, 1.8e-3, 2.0e-3, 2.3e-3]])
    prior = SpecStats(drafted_per_pos=[1000] * 4, accepted_per_pos=[620, 410, 280, 220])
    rows = [_Req([], [])] * 100
    assert DraftLenPolicy(4, adaptive=True, costs=costs, prior=lambda: prior).choose(rows) == 3
    p = DraftLenPolicy(4, adaptive=True, costs=costs, prior=lambda: prior)
    p.timed = False
    tok, sec = p._expected_tokens(rows), costs.seconds[0]
    per_step = sec[2] * (1 - tok[2] / sec[2] / (tok[3] / sec[3]))
    rent = math.ceil(CAPTURE_SECONDS / per_step) - 1  # steps whose losses stay below a capture's cost
    assert 10 < rent < 10_000
    assert [p.choose(rows, captured=GraphCheck(lambda d: d in (2, 4))) for _ in range(rent)] == [2] * rent
    assert p.choose(rows[:99], captured=GraphCheck(lambda d: d in (2, 4))) == 2  # other rows: a debt of their own
    assert p.choose(rows, captured=GraphCheck(lambda d: d in (2, 4))) == 3  # now the capture has paid
    # D = 3's graph is not there yet (the step that took it verified wider drafts): the debt stands, D = 3 again
    assert p.choose(rows, captured=GraphCheck(lambda d: d in (2, 4))) == 3 and p.rent.owed.get((100, 3), 0) > 0
    assert p.choose(rows, captured=GraphCheck(lambda d: d in (2, 3, 4))) == 3 and not p.rent.owed.get((100, 3))
    # where the runner names the graph's layout (padded rows, table width), the rows that share it share a debt
    shared = DraftLenPolicy(4, adaptive=True, costs=costs, prior=lambda: prior)
    shared.timed = False

    in_layout = GraphCheck(lambda d: d in (2, 4), lambda: (104, 32))
    chosen = [shared.choose(rows[:100 - i % 4], captured=in_layout) for i in range(rent + 1)]
    assert chosen == [2] * rent + [3]


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
    period counts only where the last two steps were generation steps of the same rows and D and the step after
    them is a generation step of those rows too; a prompt step's, a changed D's, or the period before rows end or
    join is not recorded."""
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
    assert p.choose(rows[:3], True) == 1  # a request ended: the period before it holds that work, not recorded
    assert p.live.seconds == [[1.0, 1.6875]]
    clock[0] += 2.5
    p.choose(rows[:3], True)  # the step before had 3 rows, the one before it 4: not recorded
    assert p.live.seconds == [[1.0, 1.6875]]
    clock[0] += 2.5
    p.choose(rows[:3], False)  # a prompt joins: not recorded either
    assert p.live.seconds == [[1.0, 1.6875]]
    for _ in range(3):
        clock[0] += 2.5
        p.choose(rows[:3], True)
    assert p.live.seconds == [[1.0, 1.890625]]  # three alike generation steps of 3 rows: one period recorded


def test_a_period_counts_to_the_width_the_step_ran_at(monkeypatch):
    """A step that proposes D = 0 while its rows verify the last step's drafts runs as wide as them: under the
    overlap scheduler the period after it is the next step's (mostly that step's wait), and if it counted to D = 0
    every switch to D = 0 would charge D = 0 a wide step's cost, until D = 0 looked no cheaper than drafting. It
    counts to the column the step ran at."""
    import types

    import specserve.speculative.draft_len as draft_len

    costs = StepCosts([4], [[1.0, 1.5]])
    p = DraftLenPolicy(1, adaptive=True, costs=costs, prior=lambda: SpecStats(
        drafted_per_pos=[100], accepted_per_pos=[0]))  # nothing accepted: D = 0 the best
    rows = [_Req([], [])] * 4
    clock = [0.0]
    monkeypatch.setattr(draft_len, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    for verifying in (1, 1, 0):  # two steps verifying the last drafts (as wide as D = 1), then one of D = 0
        assert p.choose(rows, True, verifying=verifying) == 0
        clock[0] += 2.0
    assert p.live.seconds == [[1.0, 1.625]]  # the wide step's period counted to D = 1, a quarter of the way
    assert p.choose(rows, True) == 0  # the last two steps ran at different widths: nothing recorded
    assert p.live.seconds == [[1.0, 1.625]]
    clock[0] += 0.8
    assert p.choose(rows, True) == 0  # two steps of D = 0 in a row: the period counts to D = 0
    assert p.live.seconds == [[pytest.approx(0.95), 1.625]]


def test_a_batch_at_d0_probes_so_that_its_estimates_can_recover(monkeypatch):
    """A request whose first drafts were unlucky gets D = 0, and at D = 0 it verifies nothing: after
    ``PROBE_AFTER`` steps one step drafts (the best D > 0), then D = 0 again while the evidence holds, each probe
    that changed nothing doubling the wait (up to ``PROBE_MAX``); once drafting pays again the wait starts over. A
    probe keeps to a D whose step has its graph (waiting for a step that has one, up to ``PROBE_MAX`` steps)."""
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
    # a probe takes the best D > 0 among those whose step has its graph; where none has, it waits for a step that
    # has one, until the wait reaches PROBE_MAX, and then takes the best; an engine that runs no graphs captures
    # nothing, and probes on time
    def graphs(*ds):
        return GraphCheck(lambda d: d in ds, lambda: (1, 16))

    p.zero_run = p.probe_after
    assert p.choose([unlucky], generation=True, captured=graphs(0, 3)) == 3
    p.probe_after = p.zero_run = PROBE_AFTER
    for _ in range(3):
        assert p.choose([unlucky], generation=True, captured=graphs(0)) == 0
    assert p.zero_run == PROBE_AFTER + 3
    assert p.choose([unlucky], generation=True, captured=graphs(0, 1)) == 1
    assert p.zero_run == 0 and p.probe_after == 2 * PROBE_AFTER
    p.zero_run = p.probe_after
    assert p.choose([unlucky], generation=True, captured=GraphCheck(lambda d: False)) == 0  # a graph engine's
    assert p.choose([unlucky], generation=True, captured=GraphCheck(lambda d: False, graphed=False)) == 2  # none
    p.zero_run = PROBE_MAX
    assert p.choose([unlucky], generation=True, captured=graphs(0)) == 2
    tokens, seconds = p._expected_tokens([unlucky]), p.live.row(1)
    rate = {d: tokens[d] / seconds[d] for d in (1, 3, 4)}
    p.zero_run = p.probe_after
    assert p.choose([unlucky], generation=True, captured=graphs(1, 3, 4)) == max(rate, key=rate.get)
    assert len(set(rate.values())) == 3


def test_expected_tokens_are_reused_while_nothing_they_depend_on_changed(monkeypatch):
    """At D = 0 no request's counts change, so the policy reuses its last expected tokens; a changed row computes
    them again, and engine counts that moved (a request verified drafts) within ``REUSE_STEPS`` steps."""
    import specserve.speculative.draft_len as draft_len
    from specserve.speculative.draft_len import REUSE_STEPS

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
    # counts that move are taken in at most REUSE_STEPS steps later (building them costs the host per row)
    seen = [p.choose(rows[:1], True) for _ in range(REUSE_STEPS)]
    assert seen[0] > 0 and seen[-1] == 0 and len(calls) == 5
    assert p.choose(rows[:1], True) == 0 and len(calls) == 5  # nothing moved since


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


def test_a_tallied_step_counts_as_its_rows_one_by_one():
    """The engine tallies a step's rows by how they verified (``Verified``) and moves its counts once per kind of
    row: the same counts as recording every row, chains and trees (by depth) alike."""
    rows = [Verified(4, 2, 3), Verified(4, 0, 1), Verified(4, 2, 3), Verified(2, 2, 3), Verified(24, 3, 4, 5),
            Verified(24, 3, 4, 5), Verified(6, 1, 2, 6), Verified(4, 4, 5)]
    one, tallied = SpecStats(), SpecStats()
    for v in rows:
        one.record(*v)
    tallied.record_tally(Tally(rows))
    assert tallied == one
    assert tallied.num_verify_steps == len(rows) and tallied.drafted_per_pos[4] == 3
