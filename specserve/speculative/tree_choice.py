"""Tree or chain, chosen each step: ``TreeChoice``, the draft policy of a ``TreeSpeculator``.

A tree verifies 1 + N tokens a row where a chain verifies 1 + D, and drafts ``topk`` nodes a depth where a chain
drafts one. Where a step's cost hardly grows with its tokens (few rows on a GPU) the tree's longer accepted paths
pay; where it grows (many rows) they may not. With ``tree_max_batch_size`` set, steps of more rows than that draft
chains. Without it (the default, on CUDA graphs), each step drafts whichever promises more tokens per second:

* seconds: a step of the batch's rows, tree and chain, measured at engine start (``step_costs.measure_step_costs``
  over both kinds of step, or loaded from ``step_cost_file``), then moved towards the periods the engine really
  observes (``StepCosts.observe``, as ``adaptive_draft_len`` does);
* tokens: 1 + the sum over depths of how often an accepted path reached that depth, counted apart for the
  engine's tree steps and its chain steps (a row's own counts are not used: a row's tree and chain steps
  interleave, and one engine-wide figure per kind is what the two costs are weighed against), halved whenever a
  kind's rows pass ``WINDOW`` so that they follow the prompts the engine is serving now. Counts start from an
  optimistic prior (``draft_len.engine_rates``: every depth accepted, weighted as ``PRIOR_STEPS`` steps), so each
  kind is tried early and kept only while its counts bear it out.

A kind left unchosen for ``PROBE_AFTER`` generation steps in a row is drafted once, so that its counts can move;
each probe that changed nothing doubles the wait, up to ``PROBE_MAX``. Steps with prompt tokens neither probe nor
count towards one (an engine that always has a prompt in flight keeps its estimates until a generation step). A
tree of N = D nodes verifies as many tokens as the chain: nothing to weigh, the fixed rule decides.

Graphs: a step's graph is fixed by the width its rows verify (the kind the step before drafted: 1 + D or 1 + N
tokens a row) and by the kind it drafts, so each (rows, table width) has four: two kinds, and two steps that switch
between them. A capture mid-run costs some 0.1 s, more than a kind's edge wins over a short run. So, as a chain's
adaptive draft length does (``draft_len.prefer_captured``), a step whose better kind lacks a graph it would run
(this switch step's, or that kind's own) takes the kind whose graphs exist until the seconds that loses reach a
capture's, and a probe waits for a step where both graphs it runs exist (its own, and the step's after it, back at
the probed kind's width), or for ``PROBE_MAX`` steps.

Outputs never depend on the choice: the target decides every token, whatever a step verifies.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from specserve.core.metrics import Tally, Verified
from specserve.speculative.config import TREE_MAX_BATCH, SpeculativeConfig
from specserve.runner.cuda_graph import GraphCheck
from specserve.speculative.draft_len import (PROBE_AFTER, PROBE_MAX, CaptureRent, StepPeriods, best_draft_len,
                                             engine_rates)
from specserve.speculative.step_costs import StepCosts

CHAIN, TREE = 0, 1  # the columns of the step costs, and the kinds of step
WINDOW = 4096  # a kind's counts are halved when its rows verified pass this many


@dataclass
class _Tally:
    """One kind of step's acceptance by depth over the engine's rows (``engine_rates`` reads it)."""

    drafted_per_pos: np.ndarray  # [D] rows whose verified drafts reached depth j + 1
    accepted_per_pos: np.ndarray  # [D] rows whose accepted path did
    rows: float = field(default=0.0)

    @classmethod
    def empty(cls, depth: int) -> "_Tally":
        return cls(np.zeros(depth), np.zeros(depth))

    def add(self, depth: int, accepted: int, times: int = 1) -> None:
        self.drafted_per_pos[:depth] += times
        self.accepted_per_pos[:min(accepted, depth)] += times
        self.rows += times
        if self.rows > WINDOW:
            self.drafted_per_pos *= 0.5
            self.accepted_per_pos *= 0.5
            self.rows *= 0.5


def measurement_tree(topk: int, depth: int, nodes: int) -> list[int]:
    """Parents (columns, 0 the root) of a tree of ``nodes`` nodes shaped as the expansion shapes one: ``topk``
    children of the root, then at each next depth ``topk`` children of each of the ``topk`` first nodes of the
    depth before, sorted by depth, at most ``depth`` deep (the step costs' verified tree)."""
    parents: list[int] = []
    level = [0]  # the depth before's columns
    for _ in range(depth):
        nxt = []
        for p in level[:topk]:
            for _ in range(topk if len(parents) < nodes else 0):
                parents.append(p)
                nxt.append(len(parents))
        level = nxt
    return parents[:nodes]


class TreeChoice:
    """Tree (N drafts a row) or chain (D) for each step (module docstring). The interface of
    ``DraftLenPolicy`` that the engine and the speculator use: ``choose``, ``observe``, ``costs``, ``timed``."""

    varies = False  # a chain step through the tree's code always drafts D

    def __init__(self, spec: SpeculativeConfig) -> None:
        self.spec = spec  # read at each step: ``tree_max_batch_size`` may be set after construction
        self.draft_len, self.num_nodes = spec.max_draft_len, spec.num_nodes
        self.costs = None  # set by the engine where it measures them (``measures_tree_costs``)
        # the engine's chain steps' and tree steps' acceptance by depth
        self.counts = (_Tally.empty(self.draft_len), _Tally.empty(self.draft_len))
        self.kind = TREE  # this step's (``choose``), which ``TreeSpeculator.plan_step`` reads
        self.last: int | None = None  # the kind chosen for the generation step before (not a probe)
        self.run = 0  # generation steps in a row of that kind
        self.probe_after = PROBE_AFTER
        self.timed = True  # observe step periods (off under tensor parallelism: ranks must choose alike)
        self.periods = StepPeriods()
        self.rent = CaptureRent()  # what taking the kind with a graph instead of the better one has lost so far

    @property
    def costs(self) -> StepCosts | None:
        """Seconds of a step by rows, [chain, tree]; ``live`` holds their estimates as steps are observed."""
        return self._costs

    @costs.setter
    def costs(self, costs: StepCosts | None) -> None:
        if costs is not None and costs.max_draft_len != TREE:
            raise ValueError("a tree's step costs hold two kinds of step: [chain, tree]")
        self._costs = costs
        self.live = None if costs is None else costs.copy()

    def options(self) -> dict[int, list[int] | None] | None:
        """The steps whose costs are measured, in the costs' column order: drafts a row -> the parents of the
        drafts it verifies; None for a tree of N = D nodes (the fixed rule)."""
        if self.num_nodes == self.draft_len:
            return None
        return {self.draft_len: list(range(self.draft_len)),
                self.num_nodes: measurement_tree(self.spec.topk, self.draft_len, self.num_nodes)}

    def expected_tokens(self) -> np.ndarray:
        """Tokens a row emits per step, [chain, tree]: 1 + how often an accepted path reaches each depth."""
        out = []
        for counts in self.counts:
            rate = np.minimum.accumulate(engine_rates(counts, self.draft_len))  # [D]
            out.append(1.0 + rate.sum())
        return np.array(out)

    def choose(self, requests: list, generation: bool = False, captured: GraphCheck | None = None,
               verifying: int = 0) -> int:
        """The kind of a step of these rows (``kind``) -> the drafts it proposes a row: N (a tree) or D (a
        chain). ``generation``: every row verifies and samples; only such steps count towards a probe.
        ``verifying``: the most drafts a row verifies (more than D: the rows verify a tree, and the step runs as
        wide as one). ``captured``: which graphs of the step's rows exist (None: no graph step); the kind whose
        graphs exist runs instead of a better one without until what that loses reaches a capture's cost
        (``CaptureRent``), and a probe waits for a step where its graphs exist (until ``PROBE_MAX``)."""
        now, rows = time.perf_counter(), len(requests)
        if self.live is None:  # the fixed rule
            cap = self.spec.tree_max_batch_size
            kind = TREE if rows <= (TREE_MAX_BATCH if cap is None else cap) else CHAIN
        else:
            runs = self._graphs(captured)
            now_kind = TREE if verifying > self.draft_len else CHAIN  # the width the rows verify at

            def has(k: int) -> bool:  # taking kind k from here: this step's graph, then its own steps'
                return runs(now_kind, k) and runs(k, k)

            tokens, seconds = self.expected_tokens(), self.live.row(rows)
            kind = best = best_draft_len(tokens, seconds, TREE, self.last)
            if captured is not None:
                kind = best = self.rent.choose(tokens, seconds, TREE, best, captured, has, rows)
            if generation:
                self.run = self.run + 1 if best == self.last else 1
                if best != self.last:
                    self.probe_after = PROBE_AFTER
                self.last = best
                # a probe of the other kind, this step only, where its step's graph and the step's after it (back
                # to this kind, at the other's width) exist (a capture mid-run costs more than a probe finds), or
                # once the wait reaches PROBE_MAX
                other = 1 - best
                if self.run >= self.probe_after and (runs(now_kind, other) and runs(other, best)
                                                     or self.run >= PROBE_MAX):
                    self.run, kind = 0, other
                    self.probe_after = min(2 * self.probe_after, PROBE_MAX)
        self.kind = kind
        self.periods.launch(self.live if self.timed else None, rows, kind, generation, now)
        return self.num_nodes if kind == TREE else self.draft_len

    def _graphs(self, captured: GraphCheck | None) -> Callable[[int, int], bool]:
        """Whether the step's graph exists as wide as one kind verifies and drafting another: (width kind,
        drafting kind) -> bool (always where the engine runs no graphs)."""
        if captured is None or not captured.graphed:
            return lambda width, drafting: True
        q = (1 + self.draft_len, 1 + self.num_nodes)
        drafts = (self.draft_len, self.num_nodes)
        return lambda width, drafting: captured.graph_runs(q[width], drafts[drafting])

    def observe(self, tally: Tally[Verified]) -> None:
        """A collected step's rows, tallied by how they verified (``Verified``: drafts, accepted, depth of what
        they verified): a row that verified more drafts than its depth verified a tree, the others a chain."""
        for v, n in tally.items():
            if v.num_drafts > 0 and v.depth:
                self.counts[TREE if v.num_drafts > v.depth else CHAIN].add(v.depth, v.num_accepted, n)
