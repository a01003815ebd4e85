"""How many drafts a step proposes, D in 0..max_draft_len, chosen on the host before the step is staged.

Three policies, composed into one ``DraftLenPolicy`` (chosen once, at engine start):

* fixed: every step drafts ``max_draft_len`` (the default);
* ``draft_len_schedule`` (TensorRT-LLM's): {batch size: D}; a step of B rows drafts the D of the smallest key
  >= B, and 0 (no speculation) past the largest key;
* ``adaptive_draft_len``: each step the D of most expected tokens per second, from the seconds of a step of that
  many rows and that D and the acceptance the batch's requests are getting (``expected_tokens``). The seconds
  start as measured at engine start (``StepCosts``, by ``measure_step_costs``, or loaded from
  ``step_cost_file``): synthetic steps without the engine's per-row host work (scheduling, token updates,
  detokenizing), so they are lower bounds where the host is the bottleneck. Each generation step's observed
  period (from one choice to the next) then moves the estimate of its rows and the width it ran at (the larger
  of its D and the drafts it verified) towards what the engine really pays; a D not run keeps its lower
  estimate, so it is tried once the one in use has grown past it (``observe``). After ``PROBE_AFTER`` steps of
  D = 0 in a row one step drafts, so that the requests' estimates can recover (the wait doubling after each
  probe that changed nothing, up to ``PROBE_MAX``). Where the step runs as a CUDA graph
  and another D already has its graph, a D without one is first rented, not bought (``prefer_captured``): the
  steps take the best D that has a graph and count the seconds that costs them against the best, and the best D's
  graph is captured once those seconds reach what a capture costs (``CAPTURE_SECONDS``; the graph weighed is each
  D's own, which the steps after a choice run, not that of the step that still verifies the last drafts, and the
  debt stands until that graph exists), so that a batch draining through its batch sizes does not capture graphs
  mid-run that its few steps at a size never repay, while a batch size that lasts gets its best D (a probe too
  waits for a step whose graph a D > 0 has, up to ``PROBE_MAX`` steps, unless the engine runs no graphs). Where
  D = 0 is the best it is taken at once, graph or not: its steps are plain ones, whose graph a plain engine
  captures wherever it runs, so a head that does not pay falls back to plain steps without renting a drafting D
  first;

and, over any of them, TensorRT-LLM's speculation gate: once the acceptance rate (accepted / drafted) over the
last ``acceptance_rate_window_size`` speculative steps falls below ``acceptance_rate_threshold``, the engine
stops drafting for good.

Outputs never depend on D: a step verifies whatever the step before drafted (0 included) and the target decides
every token. A step that drafts 0 runs no draft head at all, so the head's KV misses that step's positions; its
later drafts read stale keys there, which can lower acceptance, never change a token. One that verifies nothing
either (nor continues, under the overlap scheduler, a row whose step verifies drafts) is a plain step
(``Speculator.drafts_nothing``): held at D = 0, an engine's steps cost what no speculation's do.
"""

from __future__ import annotations

import operator
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

import numpy as np

from specserve.core.metrics import SpecStats, Tally, Verified
from specserve.runner.cuda_graph import GraphCheck
from specserve.speculative.step_costs import StepCosts

# acceptance of a request that has verified nothing yet: the engine's, weighted as this many of its own steps
PRIOR_STEPS = 4.0
# a step keeps the D of the step before unless another promises this much more tokens per second
SWITCH_GAIN = 0.02
# a D whose step has no CUDA graph yet costs a capture: an eager step, then the capture, about this many seconds
# with the kernels compiled (docs/BENCHMARKS.md, "What a capture costs"), a hundred steps or more. While another D
# has its graph for the step, the best D's is captured only once the steps that took that other D instead lost this
# many seconds against it (renting until the rent paid would have bought it: never more than twice the best cost)
CAPTURE_SECONDS = 0.1
# after this many steps in a row that the adaptive rule gave D = 0 one step drafts again: a batch at D = 0
# verifies nothing, so without a probe its requests' estimates could never recover from an unlucky start. Each
# probe that leaves the rule at D = 0 doubles the wait, up to PROBE_MAX steps (a head that never pays, e.g. on
# prompts far from its training, costs a probe step and the verify step after it per PROBE_MAX steps, not 2 of 33).
# The wait is not reset when a request joins: with no counts of its own it is judged by the engine's, the best
# evidence there is (probes correct a request's own unlucky counts, which the engine's would not)
PROBE_AFTER = 32
PROBE_MAX = 1024
# while a batch's rows stay the same and the engine's verify steps since its expected tokens were computed are at
# most REUSE_SHARE of those they counted, the tokens are computed again at most every REUSE_STEPS steps (at D = 0 no
# count moves, and they are reused for good): building them costs the host about 1 us a row (131 us at 128 rows on
# this project's CPU; a 128-row step is about 2 ms on the H100, and at that size the host's work before a step
# likely sets the pace), and once there is evidence a few dozen steps' more move estimates blended over hundreds of
# steps by little (the first steps, where evidence is thin, compute them every step)
REUSE_STEPS = 32
REUSE_SHARE = 1 / 8


def engine_rates(prior: SpecStats, max_draft_len: int) -> np.ndarray:
    """Per-position acceptance over the engine's steps [D]: position j's counts blended with an optimistic prior of
    ``PRIOR_STEPS`` steps at the rate of position j - 1 (1.0 before the first). Thin counts stay near that prior,
    so a few unlucky early steps cannot stop a position from being drafted (and its estimate from ever being
    corrected): only a rate measured over many steps can."""
    out = np.empty(max_draft_len)
    last = 1.0
    for j in range(max_draft_len):
        n = prior.drafted_per_pos[j] if j < len(prior.drafted_per_pos) else 0
        a = prior.accepted_per_pos[j] if j < len(prior.accepted_per_pos) else 0
        last = out[j] = (a + PRIOR_STEPS * last) / (n + PRIOR_STEPS)
    return out


def expected_tokens(stats: list[SpecStats], prior: SpecStats, max_draft_len: int) -> np.ndarray:
    """Expected tokens a batch emits per step for each D = 0..max_draft_len [D+1]: per row 1 + sum over the
    first D positions of P(the draft there is accepted | drafted), from its own counts blended with the engine's
    rates (``engine_rates``) weighted as ``PRIOR_STEPS`` steps. One array operation over the rows: this runs on
    the host before every step, so its cost must not grow by a Python loop's worth per row."""
    d = max_draft_len
    glob = engine_rates(prior, d)  # [D]
    if not stats:
        return np.zeros(d + 1)
    pad = [0] * d
    drafted = np.array([(s.drafted_per_pos + pad)[:d] for s in stats], dtype=np.float64)  # [B, D]
    accepted = np.array([(s.accepted_per_pos + pad)[:d] for s in stats], dtype=np.float64)  # [B, D]
    rate = (accepted + PRIOR_STEPS * glob) / (drafted + PRIOR_STEPS)
    # a chain accepts position j only after every position before it: rates per position are already
    # conditional on being drafted, and accepted counts are prefixes, so they are non-increasing here
    rate = np.minimum.accumulate(rate, axis=1)
    return len(stats) + np.concatenate(([0.0], rate.sum(axis=0).cumsum()))


def best_draft_len(tokens: np.ndarray, seconds: list[float], allowed: int, current: int | None = None) -> int:
    """The D in 0..``allowed`` of most expected tokens per second (``tokens`` [D+1] per step, ``seconds``
    per step); ties go to the shorter D. Where ``current`` (the D of the step before) is allowed, it stays unless
    another D promises ``SWITCH_GAIN`` more: a step after a change of D drafts or verifies as many as the longer of
    the two (``Speculator.plan_step``), and estimates near a tie would otherwise flip every step."""
    n = min(allowed, len(seconds) - 1, len(tokens) - 1)
    rates = [tokens[d] / seconds[d] for d in range(n + 1)]
    best = 0
    for d in range(1, n + 1):
        if rates[d] > rates[best] * (1 + 1e-9):
            best = d
    if current is not None and current <= n and rates[best] <= rates[current] * (1 + SWITCH_GAIN):
        return current
    return best


def prefer_captured(tokens: np.ndarray, seconds: list[float], allowed: int, best: int,
                    captured: Callable[[int], bool], owed: float = 0.0) -> tuple[int, float]:
    """``best`` (``best_draft_len``'s choice), or where its step has no graph yet (``captured(D)``: whether D's has)
    the D of most expected tokens per second among those that have one, until the seconds ``owed`` (what steps took
    that D instead of ``best`` lost so far) and this step's loss reach ``CAPTURE_SECONDS`` -> (the D, the seconds
    this step loses against ``best``: 0 where it takes ``best``)."""
    if captured(best):
        return best, 0.0
    n = min(allowed, len(seconds) - 1, len(tokens) - 1)
    have = [d for d in range(n + 1) if captured(d)]
    if not have:
        return best, 0.0
    rate = [tokens[d] / seconds[d] for d in range(n + 1)]
    alt = max(have, key=lambda d: (rate[d], -d))
    lost = max(0.0, seconds[alt] * (1 - rate[alt] / rate[best])) if rate[best] > 0 else 0.0
    return (best, 0.0) if owed + lost >= CAPTURE_SECONDS else (alt, lost)


class CaptureRent:
    """``prefer_captured``'s bookkeeping for a policy: the seconds lost so far by steps of (what their graphs share,
    best option) that took an option with a graph instead of that best one, which had none; kept until the best
    one's graph exists (the step that first takes it may still verify wider drafts, in another graph). The key
    leaves out the width the rows verify: a chain's debt in a tree engine is cleared where the chain's own graph
    exists, though the switch step's from a tree's width may still be missing (one capture, once a layout)."""

    def __init__(self) -> None:
        self.owed: dict[tuple, float] = {}

    def choose(self, tokens: np.ndarray, seconds: list[float], allowed: int, best: int, captured: GraphCheck,
               has: Callable[[int], bool], rows: int) -> int:
        """``best``, or the option with a graph that ``prefer_captured`` takes instead while the debt is short of a
        capture; losses count per graph layout where the step has one (else per row count)."""
        layout = captured.layout()
        key = (layout if layout is not None else rows, best)
        pick, lost = prefer_captured(tokens, seconds, allowed, best, has, self.owed.get(key, 0.0))
        if lost:
            self.owed[key] = self.owed.get(key, 0.0) + lost
        elif has(best):  # paid off
            self.owed.pop(key, None)
        return pick


@dataclass
class _TokensMemo:
    """The last expected tokens (``DraftLenPolicy._expected_tokens``) and what they were computed from."""

    requests: list  # the rows' requests (each keeps its ``spec_stats`` object)
    counts: tuple[int, int, int]  # the engine's verify steps, drafted and accepted
    tokens: np.ndarray  # [D+1]
    reused: int = 0  # steps since they were computed


@dataclass
class _Launch:
    """A step a policy chose for (``StepPeriods``)."""

    rows: int
    # the column of ``StepCosts`` it ran (a chain: max(D, drafts verified); a tree engine: its option's, -1 for the
    # switch step from the tree's width to a chain, ``TreeChoice._column_run``)
    option: int
    generation: bool
    time: float  # perf_counter seconds at the choice


class StepPeriods:
    """Observed step periods (from one choice to the next) as the cost of the last step's (rows, option) where
    that is unambiguous: the last two steps and this one are generation steps of the same rows, the last two of
    the same option, the option being the step's column of the costs as it ran (a chain's step that proposes D
    while verifying wider drafts runs as wide as them). (Under the overlap scheduler the period from one launch to
    the next mostly waits for the step before to finish, so a period is the cost of a step where both agree; a step
    that changes option, a probe included, is not recorded.)"""

    def __init__(self) -> None:
        self._launched: deque[_Launch] = deque(maxlen=2)  # the last two steps chosen for

    def launch(self, live: StepCosts | None, rows: int, option: int, generation: bool, now: float) -> None:
        """A step chosen at ``now``: first the period since the last choice moves ``live`` (None: not timed). The
        period is the last step's cost only where this step, too, is a generation step of its rows: before a step
        whose rows changed the host finished requests or admitted prompts (a whole reply detokenized, a prompt
        staged), which a step that ends a request would otherwise be charged; where the policy picks a D for a
        request's last steps alone (its graph exists only at the longest table widths, say), that D's estimate
        would climb on those periods and the D never be taken elsewhere."""
        if live is not None and len(self._launched) == 2:
            a, b = self._launched
            if generation and a.generation and b.generation and a.rows == b.rows == rows and a.option == b.option:
                live.observe(b.rows, b.option, now - b.time)
        self._launched.append(_Launch(rows, option, generation, now))


class AcceptanceGate:
    """TensorRT-LLM's speculation gate: the acceptance rate (accepted / drafted) summed over the last ``window``
    speculative steps; below ``threshold`` once the window is full, speculation stops for good."""

    def __init__(self, window: int, threshold: float) -> None:
        self.window, self.threshold = window, threshold
        self.steps: deque[tuple[int, int]] = deque(maxlen=window)  # (drafted, accepted) per step
        self.closed = False

    def observe(self, drafted: int, accepted: int) -> None:
        if self.closed or drafted <= 0:
            return
        self.steps.append((drafted, accepted))
        if len(self.steps) == self.window:
            d = sum(s[0] for s in self.steps)
            a = sum(s[1] for s in self.steps)
            self.closed = a < self.threshold * d


class DraftLenPolicy:
    """The drafts each step proposes (module docstring). ``choose`` runs on the host at each launch; ``observe``
    takes each collected step's rows, tallied (drafted, accepted, emitted: its own counts, the prior, and the gate's).
    ``prior``: other counts to blend requests' with instead of those (tests)."""

    def __init__(self, max_draft_len: int, schedule: dict[int, int] | None = None, adaptive: bool = False,
                 gate: AcceptanceGate | None = None, costs: StepCosts | None = None,
                 prior: Callable[[], SpecStats] | None = None) -> None:
        self.max_draft_len = max_draft_len
        self.schedule = sorted(schedule.items()) if schedule else None
        self.adaptive = adaptive
        self.gate = gate
        self.costs = costs  # None while adaptive: every step drafts the most (until the engine measures them)
        self.last: int | None = None  # the D chosen for the step before
        self.zero_run = 0  # steps in a row the adaptive rule gave D = 0
        self.probe_after = PROBE_AFTER  # the zero run that ends in a probe (doubles while probes change nothing)
        # the last expected tokens and what they were computed from: a step at D = 0 changes no request's counts,
        # so a batch that stays there reuses them instead of rebuilding its [B, D] arrays every step
        self._tokens_memo: _TokensMemo | None = None
        self.rent = CaptureRent()  # what taking a D with a graph instead of the best D has lost so far
        # observe step periods (``observe``); off under tensor parallelism, where every rank must choose alike
        # and each rank's clock differs
        self.timed = True
        self.periods = StepPeriods()
        # the engine's acceptance, counted here from every collected step (``observe``) rather than read from the
        # engine's reported counts, which a caller may reset (``bench`` does before each timed run): an engine that
        # had learnt its head accepts nothing would start each run optimistic again, drafting 4 and probing
        self.counts = SpecStats()
        self.prior = prior or (lambda: self.counts)

    @property
    def costs(self) -> StepCosts | None:
        """The step costs the engine measured or loaded; ``live`` holds their estimates as steps are observed."""
        return self._costs

    @costs.setter
    def costs(self, costs: StepCosts | None) -> None:
        self._costs = costs
        self.live = None if costs is None else costs.copy()

    @classmethod
    def from_config(cls, spec) -> "DraftLenPolicy":
        """The policy a ``SpeculativeConfig`` asks for (fixed D unless it sets a schedule, the gate or adaptive)."""
        gate = None
        if spec.acceptance_rate_window_size is not None:
            gate = AcceptanceGate(spec.acceptance_rate_window_size, spec.acceptance_rate_threshold)
        return cls(spec.max_draft_len, spec.draft_len_schedule, spec.adaptive_draft_len, gate)

    @property
    def varies(self) -> bool:
        """Whether steps may draft fewer than ``max_draft_len``."""
        return self.schedule is not None or self.adaptive or self.gate is not None

    def _cap(self, rows: int) -> int:
        if self.gate is not None and self.gate.closed:
            return 0
        if self.schedule is None:
            return self.max_draft_len
        for bound, d in self.schedule:
            if rows <= bound:
                return min(d, self.max_draft_len)
        return 0

    def choose(self, requests: list, generation: bool = False, captured: GraphCheck | None = None,
               verifying: int = 0) -> int:
        """The D of a step whose rows are these requests' (each has ``spec_stats``); ``generation``: every row
        verifies and samples (no prompt tokens); ``captured``: which D have the step's graph (``prefer_captured``;
        None: no graph step) and the graph's layout, which a rented D's losses are counted by (else the rows);
        ``verifying``: the most drafts a row of the step verifies (it runs as wide as the larger of those and D:
        the step costs column max(D, verifying), which its observed period is counted to)."""
        now = time.perf_counter()
        d = self._cap(len(requests))
        if self.adaptive and self.live is not None and d > 0:
            tokens = self._expected_tokens(requests)
            seconds = self.live.row(len(requests))
            best = best_draft_len(tokens, seconds, d, self.last)
            # D = 0's steps verify and draft nothing: plain steps (``Speculator.drafts_nothing``), in the graphs a plain
            # engine captures at every layout it meets, so D = 0 is never rented against
            if captured is not None and best > 0:
                best = self.rent.choose(tokens, seconds, d, best, captured, captured.has, len(requests))
            self.zero_run = self.zero_run + 1 if best == 0 else 0
            if best > 0:
                self.probe_after = PROBE_AFTER
            # a probe: the best D > 0 for this step only (``PROBE_AFTER``), among those whose step has its graph
            # (any D where the engine runs no graphs); where none has, the probe waits for a step that has one (a
            # capture, about 0.1 s, would cost a short run more than the probe can find), until the wait reaches
            # PROBE_MAX steps. ``last`` keeps 0
            rates = [tokens[k] / seconds[k] for k in range(1, min(d, len(seconds) - 1, len(tokens) - 1) + 1)]
            have = []
            if self.zero_run >= self.probe_after:
                eager = captured is None or not captured.graphed
                have = [k for k in range(1, len(rates) + 1) if eager or captured.has(k)]
            if have or (rates and self.zero_run >= PROBE_MAX):
                self.zero_run = 0
                self.probe_after = min(2 * self.probe_after, PROBE_MAX)
                d = max(have or range(1, len(rates) + 1), key=lambda k: (rates[k - 1], -k))
            else:
                d = self.last = best
        else:
            self.last = d
        self.periods.launch(self.live if self.timed else None, len(requests), max(d, verifying), generation, now)
        return d

    def _expected_tokens(self, requests: list) -> np.ndarray:
        """``expected_tokens`` for these rows (requests with ``spec_stats``), reused while the rows are the same and
        either the engine's counts (which every request's verification adds to) did not change or they moved
        little, for fewer than ``REUSE_STEPS`` steps (``REUSE_SHARE``)."""
        prior = self.prior()
        counts = (prior.num_verify_steps, prior.num_drafted, prior.num_accepted)
        memo = self._tokens_memo
        # the memo holds the requests: their ids are not reused
        if memo is not None and len(memo.requests) == len(requests) and all(map(operator.is_, memo.requests,
                                                                                requests)) and (
                memo.counts == counts or (memo.reused < REUSE_STEPS - 1
                                          and 0 <= counts[0] - memo.counts[0] <= REUSE_SHARE * memo.counts[0])):
            memo.reused += 1
            return memo.tokens
        tokens = expected_tokens([r.spec_stats for r in requests], prior, self.max_draft_len)
        self._tokens_memo = _TokensMemo(list(requests), counts, tokens)
        return tokens

    def observe(self, tally: Tally[Verified]) -> None:
        """A collected step's rows, tallied by how they verified (``Verified``: drafts, accepted, emitted, depth):
        the engine's counts (the prior) and the gate's."""
        self.counts.record_tally(tally)
        if self.gate is not None:
            self.gate.observe(sum(v.num_drafts * n for v, n in tally.items()),
                              sum(v.num_accepted * n for v, n in tally.items()))
