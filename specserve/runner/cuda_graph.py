"""CUDA graphs for generation steps: one captured graph per (layout, variant), replayed every step.

A *layout* (``GraphLayout``) fixes every shape of a step: rows padded to a captured batch size, tokens per
row (1, 1 + D when verifying drafts, or a prefill's power of two), block-table width. A *variant*
holds the host-known switches a step's code takes (all greedy, top-k/p filtering, the relaxed-acceptance
window), so a replay runs exactly the kernels an eager step would. The runner uploads a step's inputs into
staging buffers whose device addresses depend only on the layout; the captured graph reads them there.
Graphs are captured lazily, on the first step that needs one (a warm-up run first compiles the Triton
kernels and sets up cuBLAS), and all share one memory pool: steps run one at a time, so their temporaries
can share memory.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Hashable

import torch

from specserve.runner.graph_layout import GraphLayout

log = logging.getLogger("specserve")


def capture_sizes(max_rows: int) -> list[int]:
    """Batch sizes that get graphs (vLLM's ladder): 1, 2, 4, 8, then every 8 up to ``max_rows``."""
    sizes = [s for s in (1, 2, 4) if s < max_rows] + list(range(8, max_rows + 8, 8))
    return sorted({min(s, max_rows) for s in sizes} | {max_rows})


@dataclass(frozen=True)
class GraphCheck:
    """Which draft lengths a step has its CUDA graph for (``ModelRunner._graph_check``), for choices that weigh a
    capture (``draft_len.prefer_captured``)."""

    has: Callable[[int], bool]  # whether the step's graph exists when it proposes D drafts a row
    # what every D's graph of the step shares: a generation step's padded rows and table width, a prompt step's
    # prefill layout (None: no graph step)
    layout: Callable[[], Hashable | None] = lambda: None
    # whether the engine runs graphs at all (False: no step captures anything; a graph engine's step of no layout
    # still runs its generation rows in a graph of their own)
    graphed: bool = True
    # whether the step's graph exists with q tokens a row while proposing s drafts (a prefill layout's q is its
    # own: q is not read there); ``has(s)`` is ``runs(1 + s, s)``, the graph of the steps that keep s, and a tree's
    # steps that switch between tree and chain run a graph of one kind's width and the other's drafting. None:
    # only ``has`` is known (``runs`` then answers it where q is 1 + s, and no other width)
    runs: Callable[[int, int], bool] | None = None

    def graph_runs(self, q: int, s: int) -> bool:
        """``runs(q, s)``, or where only ``has`` is given, ``has(s)`` for q = 1 + s."""
        return self.runs(q, s) if self.runs is not None else q == 1 + s and self.has(s)


def graph_check(graphs: "CudaGraphs | None", shared: Callable[[], Hashable | None],
                switches: Callable[[int], tuple[int, int]]) -> GraphCheck:
    """A step's ``GraphCheck`` over ``graphs`` (None: no graphs): ``shared()`` is what its graphs share (a
    generation step's (padded rows, table width), a prompt step's prefill ``GraphLayout``, or None), asked once;
    ``switches(s)`` the draft-length and top-k switches of a step proposing s drafts (``GraphKey.kind``)."""
    memo: list = []

    def layout() -> Hashable | None:
        if not memo:
            memo.append(shared())
        return memo[0]

    answers: dict[tuple[int, int], bool] = {}  # a choice asks about each (q, s) more than once

    def runs(q: int, s: int) -> bool:
        if (q, s) not in answers:
            k = layout()
            answers[q, s] = k is not None and graphs.has(
                (k if isinstance(k, GraphLayout) else GraphLayout(k[0], q, k[1]), *switches(s)))
        return answers[q, s]

    return GraphCheck(lambda s: runs(1 + s, s), layout, graphs is not None, runs)


class CudaGraphs:
    def __init__(self, max_rows: int, staging: list, capture: bool = True) -> None:
        self.capture = capture  # False (CPU tests): padded fixed layouts, run eagerly without a graph
        self.sizes = capture_sizes(max_rows)
        self.max_rows = max_rows
        self._staging = staging  # Staging buffers the graphs read; a reallocation invalidates every graph
        self._graphs: dict[Hashable, tuple[torch.cuda.CUDAGraph, object]] = {}
        self._pool = None
        self._generation: tuple[int, ...] | None = None
        self.steps = 0  # replays (or runs) of a graph layout: each part of a split engine step counts
        self.captures = 0  # graphs captured so far (never lowered: a moved staging buffer drops the graphs)
        self._kinds: set = set()  # ``has``'s kinds of the keys with a graph (without capture: of the keys run)

    def padded_rows(self, rows: int) -> int | None:
        """The smallest captured size >= rows, or None when the batch is too large for a graph."""
        return next((s for s in self.sizes if s >= rows), None)

    def has(self, kind) -> bool:
        """Whether a step of ``kind`` costs no capture: a graph of a key of that kind (a runner's ``GraphKey.kind``:
        its layout, draft length and top-k switches, whatever its sampling switches; another key: itself) is
        captured and the staging buffers have not moved since. Without capture (enforce_eager, CPU tests), whether
        a step of it ran since they last moved: the same answers as with capture, so that choices made on them
        (the draft length, tree or chain) stay the same."""
        return kind in self._kinds and tuple(s.generation for s in self._staging) == self._generation

    @property
    def num_captured(self) -> int:
        return len(self._graphs)

    def captured_for(self, layout) -> list[torch.cuda.CUDAGraph]:
        """The graphs captured for ``layout`` (one per set of host switches), in capture order."""
        return [g for key, (g, _) in self._graphs.items() if key[0] == layout]

    def run(self, key: Hashable, step: Callable[[], object], rerun: bool = True):
        """Replay the graph of ``key`` (capturing ``step`` first if needed) and return its outputs. A capture
        runs the step once eagerly first (the warm-up) and then replays it; with ``rerun`` False (a step that
        changes its own inputs, as the overlap scheduler's correction does) the warm-up is the step's one run and
        its outputs are returned."""
        self.steps += 1
        gen = tuple(s.generation for s in self._staging)
        if gen != self._generation:  # a staging buffer moved: graphs would read stale addresses
            self._graphs.clear()
            self._kinds.clear()
            self._pool = None  # freed with its last graph; capturing into it again trips the allocator
            self._generation = gen
        kind = getattr(key, "kind", key)
        if not self.capture:
            self._kinds.add(kind)
            return step()
        entry = self._graphs.get(key)
        if entry is None:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                warm = step()  # warm-up: Triton compilation, cuBLAS workspaces, lazy buffers
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                out = step()
            self._pool = graph.pool()
            entry = self._graphs[key] = (graph, out)
            self._kinds.add(kind)
            self.captures += 1
            log.debug("captured CUDA graph %s (%d in all)", key, len(self._graphs))
            if not rerun:
                return warm
        entry[0].replay()
        return entry[1]
