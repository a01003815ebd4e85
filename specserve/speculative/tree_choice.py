"""Tree or chain, and the chain's length, chosen each step: ``TreeChoice``, the draft policy of a
``TreeSpeculator``.

A tree verifies 1 + N tokens a row where a chain of d verifies 1 + d, and drafts ``topk`` nodes a depth where a
chain drafts one. Where a step's cost hardly grows with its tokens (few rows on a GPU) the tree's longer accepted
paths pay; where it grows (many rows) they may not, and a chain shorter than the tree's depth D may beat both. With
``tree_max_batch_size`` set, steps of more rows than that draft chains of D. Without it (the default, on CUDA
graphs), each step takes the option of most expected tokens per second among the chains of 1..D drafts and the
tree (the options, in the costs' column order: ``drafts`` = [1, ..., D, N]):

* seconds: a step of the batch's rows for each option, measured at engine start (``step_costs.measure_step_costs``
  over every option, or loaded from ``step_cost_file``), then moved towards the periods the engine really observes
  (``StepCosts.observe``, as ``adaptive_draft_len`` does);
* tokens: 1 + the sum over depths of how often an accepted path reached that depth, counted apart for the
  engine's tree steps and its chain steps (a chain of d reads the chain's first d depths; a row's own counts are
  not used: a row's tree and chain steps interleave, and one engine-wide figure per kind is what the costs are
  weighed against), halved whenever a kind's rows pass ``WINDOW`` so that they follow the prompts the engine is
  serving now (a depth a short chain no longer drafts thus drifts back towards its optimistic prior, and the
  longer chain is tried again). Counts start from that prior (``draft_len.engine_rates``: every depth accepted,
  weighted as ``PRIOR_STEPS`` steps), so each kind is tried early and kept only while its counts bear it out.

A kind left unchosen for ``PROBE_AFTER`` generation steps in a row is drafted once (the best chain where the tree
runs, the tree where a chain does), so that its counts can move; each probe that changed nothing doubles the wait,
up to ``PROBE_MAX``. Steps with prompt tokens neither probe nor count towards one. A tree of N = D nodes verifies as
many tokens as the chain: nothing to weigh, the fixed rule decides.

Widths and graphs, as a chain's adaptive draft length keeps them few: a step drafts at least what its rows verify.
Rows verifying a chain of w that choose a chain of d run and draft a chain of max(w, d) (the host keeps the first
d: ``TreeSpeculator.results``), the graph of that chain's own steps; rows choosing the tree run at the tree's width
(1 + N: the tree's own graph, whatever they verify); rows verifying a tree that choose a chain draft a chain of D at
the tree's width (the one switch graph). So each (rows, table width) has D + 2 graphs. A capture mid-run costs some
0.1 s, more than an option's edge wins over a short run: as a chain's adaptive draft length does
(``draft_len.prefer_captured``), a step whose better option lacks a graph it would run (this step's, or that
option's own steps') takes the best option whose graphs exist until the seconds that loses reach a capture's, and a
probe waits for a step where both graphs it runs exist (its own, and the step's after it, back to the chosen
option), or for ``PROBE_MAX`` steps.

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

CHAIN, TREE = 0, 1  # the engine's two tallies of acceptance by depth, by the kind of step that verified
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
    """The option of each step: a chain of 1..D drafts or the tree of N (module docstring). The interface of
    ``DraftLenPolicy`` that the engine and the speculator use: ``choose``, ``observe``, ``costs``, ``timed``;
    ``tree``: whether the step just chosen drafts the tree."""

    varies = False  # the tree speculator plans its widths itself (``TreeSpeculator.plan_step``)

    def __init__(self, spec: SpeculativeConfig) -> None:
        self.spec = spec  # read at each step: ``tree_max_batch_size`` may be set after construction
        self.draft_len, self.num_nodes = spec.max_draft_len, spec.num_nodes
        d = self.draft_len
        self.drafts = list(range(1, d + 1)) + [self.num_nodes]  # each option's drafts a row, the costs' columns
        self.tree_option = d  # the last column
        self.costs = None  # set by the engine where it measures them (``measures_tree_costs``)
        # the engine's chain steps' and tree steps' acceptance by depth
        self.counts = (_Tally.empty(d), _Tally.empty(d))
        self.option = self.tree_option  # this step's (``choose``), which ``TreeSpeculator.plan_step`` reads
        self.last: int | None = None  # the option chosen for the generation step before (not a probe)
        self.run = 0  # generation steps in a row of that option's kind (tree, or chain)
        self.probe_after = PROBE_AFTER
        self.timed = True  # observe step periods (off under tensor parallelism: ranks must choose alike)
        self.periods = StepPeriods()
        self.rent = CaptureRent()  # what taking an option with a graph instead of the better one has lost so far

    @property
    def tree(self) -> bool:
        return self.option == self.tree_option

    @property
    def costs(self) -> StepCosts | None:
        """Seconds of a step by rows, a column per option (``drafts``); ``live`` holds their estimates as steps
        are observed."""
        return self._costs

    @costs.setter
    def costs(self, costs: StepCosts | None) -> None:
        if costs is not None and costs.max_draft_len != self.tree_option:
            raise ValueError(f"a tree's step costs hold a column per option: chains of 1..{self.draft_len} "
                             f"drafts and the tree, {self.tree_option + 1} in all")
        self._costs = costs
        self.live = None if costs is None else costs.copy()

    def options(self) -> dict[int, list[int] | None] | None:
        """The steps whose costs are measured, in the costs' column order: drafts a row -> the parents of the
        drafts it verifies; None for a tree of N = D nodes (the fixed rule)."""
        if self.num_nodes == self.draft_len:
            return None
        out: dict[int, list[int] | None] = {d: None for d in self.drafts[:-1]}  # chains: no parents
        out[self.num_nodes] = measurement_tree(self.spec.topk, self.draft_len, self.num_nodes)
        return out

    def expected_tokens(self) -> np.ndarray:
        """Tokens a row emits per step for each option [D + 1]: chains of 1..D, then the tree; 1 + how often an
        accepted path reaches each depth (a chain of d: its first d)."""
        chain, tree = (np.minimum.accumulate(engine_rates(c, self.draft_len)) for c in self.counts)  # [D] each
        return 1.0 + np.concatenate((chain.cumsum(), [tree.sum()]))

    def choose(self, requests: list, generation: bool = False, captured: GraphCheck | None = None,
               verifying: int = 0) -> int:
        """The option of a step of these rows (``option``, ``tree``) -> the drafts it proposes a row (N for the
        tree, d for a chain of d). ``generation``: every row verifies and samples; only such steps count towards a
        probe. ``verifying``: the most drafts a row verifies (more than D: the rows verify a tree). ``captured``:
        which graphs of the step's rows exist (None: no graph step); the option whose graphs exist runs instead of
        a better one without until what that loses reaches a capture's cost (``CaptureRent``), and a probe waits
        for a step where its graphs exist (until ``PROBE_MAX``)."""
        now, rows = time.perf_counter(), len(requests)
        tree_opt = self.tree_option
        if self.live is None:  # the fixed rule
            cap = self.spec.tree_max_batch_size
            option = tree_opt if rows <= (TREE_MAX_BATCH if cap is None else cap) else self.draft_len - 1
        else:
            runs = self._graphs(captured)
            width = self._width(verifying)

            def has(o: int) -> bool:  # taking option o from here: this step's graph, then its own steps'
                return runs(*self.step_graph(width, o)) and runs(*self.step_graph(self.drafts[o], o))

            tokens, seconds = self.expected_tokens(), self.live.row(rows)
            option = best = best_draft_len(tokens, seconds, tree_opt, self.last)
            if captured is not None:
                option = best = self.rent.choose(tokens, seconds, tree_opt, best, captured, has, rows)
            if generation:
                tree = best == tree_opt
                changed = self.last is None or (self.last == tree_opt) != tree  # from chains to the tree or back
                self.run = 1 if changed else self.run + 1
                if changed:
                    self.probe_after = PROBE_AFTER
                self.last = best
                # a probe of the other kind, this step only (the tree, or the best chain), where its step's graph and
                # the step's after it (back to the chosen option, from the probe's width) exist (a capture mid-run
                # costs more than a probe finds), or once the wait reaches PROBE_MAX
                other = tree_opt if not tree else max(range(tree_opt), key=lambda o: (tokens[o] / seconds[o], -o))
                if self.run >= self.probe_after and (
                        runs(*self.step_graph(width, other)) and runs(*self.step_graph(self.drafts[other], best))
                        or self.run >= PROBE_MAX):
                    self.run, option = 0, other
                    self.probe_after = min(2 * self.probe_after, PROBE_MAX)
        self.option = option
        self.periods.launch(self.live if self.timed else None, rows, self._column_run(verifying, option),
                            generation, now)
        return self.drafts[option]

    def _width(self, verifying: int) -> int:
        """What the rows verify, as drafts a row: a chain's count, or N for a tree."""
        return self.num_nodes if verifying > self.draft_len else verifying

    def step_graph(self, verifying: int, option: int) -> tuple[int, int]:
        """The graph a step runs whose rows verify ``verifying`` drafts at most and that takes ``option``: (tokens
        a row, drafts it proposes a row, as ``GraphCheck.graph_runs`` asks; the module docstring's widths)."""
        n, d = self.num_nodes, self.draft_len
        if option == self.tree_option:
            return 1 + n, n
        if verifying > d:  # from a tree's width: a chain of D (kept to the chosen length)
            return 1 + n, d
        w = max(verifying, self.drafts[option])
        return 1 + w, w

    def _column_run(self, verifying: int, option: int) -> int:
        """The costs' column whose steps this one runs as (``StepPeriods``): an option's own, or -1 for the one
        switch step (a tree's width, drafting a chain), whose period is no option's cost."""
        q, s = self.step_graph(self._width(verifying), option)
        if q != 1 + s:
            return -1
        return self.tree_option if s > self.draft_len else s - 1

    def _graphs(self, captured: GraphCheck | None) -> Callable[[int, int], bool]:
        """Whether the step's graph of (tokens a row, drafts proposed) exists (always where the engine runs no
        graphs)."""
        if captured is None or not captured.graphed:
            return lambda q, s: True
        return captured.graph_runs

    def observe(self, tally: Tally[Verified]) -> None:
        """A collected step's rows, tallied by how they verified (``Verified``: drafts, accepted, depth of what
        they verified): a row that verified more drafts than its depth verified a tree, the others a chain."""
        for v, n in tally.items():
            if v.num_drafts > 0 and v.depth:
                self.counts[TREE if v.num_drafts > v.depth else CHAIN].add(v.depth, v.num_accepted, n)
