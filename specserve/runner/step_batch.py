"""A step's device inputs, by name: what the runner's one step function reads, however they were built.

Two builders fill a ``StepBatch``: a packed (eager) step's arrays are computed on the host with numpy
(``ModelRunner.stage``) and a graph step's from its compact record on the device (``kernels.step_inputs``, whose
PyTorch reference is ``expand_record_ref``); tests check that both give the same step. ``ArrayPack`` lays a
packed step's named arrays out in one staging buffer, so that one upload carries them all.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from specserve.models.attention import AttentionMetadata
from specserve.runner.sampler import SamplingTensors, sampling_switches
from specserve.speculative.accept import AcceptInputs


@dataclass
class SpecInputs:
    """What a speculative step verifies and drafts from (B rows, T flat tokens, D drafts, W = q + D + 2)."""

    verify_idx: torch.Tensor  # [B, D+1] int64: flat index of each verified position (the last known token first)
    verify_all: bool  # host-known: every token is verified in order (generation rows of 1 + D tokens), so the
    #                   hidden states are read in place
    drafts: torch.Tensor  # [B, D] int64: the drafts each row verifies (0 past its count)
    num_drafts: torch.Tensor  # [B] int64: drafts each row verifies this step
    base_col: torch.Tensor  # [B] int64: column of the row's last known token
    t0: torch.Tensor  # [B] int64: flat index of the row's first token
    start: torch.Tensor  # [B] int64: position of the row's first token
    ext: torch.Tensor  # [B, W] int64: the row's tokens from column 0, then the next prompt tokens (lookahead)
    row_of_token: torch.Tensor  # [T] int64
    col_of_token: torch.Tensor  # [T] int64
    accept: AcceptInputs  # per-row acceptance settings (B rows)
    host_rows: list = field(default_factory=list)  # the scheduled rows: for test heads only, never device heads
    draft_len: int = 0  # host-known: drafts this step proposes a row (a chain's; at most D)


@dataclass
class StepBatch:
    """One step's device inputs (views into the staging buffers, or what the device expanded from them)."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata  # slots [T], block tables [B, M], query layout [B, q]
    # [S] int64: flat index of each sampling row's last token; None when every row samples and row i's last token
    # is token i (a graph layout of one token per row): the hidden states are read in place, one gather fewer
    logits_indices: torch.Tensor | None
    sampling: SamplingTensors | None  # [S] rows; None when no row samples (or, speculating, inside ``spec``)
    spec: SpecInputs | None = None  # None for a plain step
    # overlap scheduler: each result row's column in the runner's ``StepCarry`` ([B] speculating, [S] plain)
    result_rows: torch.Tensor | None = None


@dataclass(frozen=True)
class StepSwitches:
    """The host-known choices a step's code takes (a CUDA graph is captured per distinct value)."""

    all_greedy: bool  # every row greedy: the random path is skipped
    needs_filter: bool  # some row filters top-k / top-p / min-p
    simple_greedy: bool = False  # speculating: every row greedy and none relaxed (acceptance reads the argmax only)
    max_topk: int = 1  # speculating: the largest relaxed top-k of the batch
    draft_topk: int = 1  # draft trees: children a node expands this step (1: the step drafts a chain)
    logprobs: int = -1  # the most top log-probabilities a row asks for (-1: none are computed)
    draft_len: int = -1  # a chain: drafts this step proposes a row (0: it runs no head); -1 otherwise

    @classmethod
    def of(cls, reqs) -> "StepSwitches":
        """The sampling switches of a batch of requests (``sampler.sampling_switches``)."""
        all_greedy, needs_filter, logprobs = sampling_switches(reqs)
        return cls(all_greedy, needs_filter, logprobs=logprobs)


@dataclass(slots=True)
class RowResult:
    """What one scheduled request got from a step."""

    tokens: list[int]  # emitted tokens, in order (empty when the row does not sample)
    drafts: list[int] = field(default_factory=list)  # drafts to verify next step
    num_drafts: int = 0  # drafts verified this step
    num_accepted: int = 0  # of those, accepted
    parents: list[int] | None = None  # a draft tree's parent columns (0: the root), one per draft; None: a chain
    depth: int | None = None  # the depth of the tree verified this step (a chain: None)
    # per emitted token: its log-probability, its rank, then the step's top log-probabilities and their ids
    # (``sampler.token_logprobs``); None when the step computed none
    logprobs: list[list[float]] | None = None

    def next_drafts(self, room: int) -> tuple[list[int], list[int] | None]:
        """The drafts to verify next step where only ``room`` more tokens may follow the emitted ones: a chain's
        first ``room``, a tree's nodes of depth <= ``room`` (a prefix: the tree is sorted by depth)."""
        if self.parents is None:
            return self.drafts[:room], None
        depth = [0]
        for p in self.parents:
            depth.append(depth[p] + 1)
        keep = sum(1 for x in depth[1:] if x <= room)
        return self.drafts[:keep], self.parents[:keep]


class ArrayPack:
    """Named arrays of given shapes laid one after another in a flat buffer (a staging buffer's host side or its
    device twin): one reserve and one upload for all of them, each read back by name."""

    def __init__(self, shapes: dict[str, tuple[int, ...]]) -> None:
        self.shapes = shapes
        self.spans: dict[str, tuple[int, int]] = {}  # name -> (offset, length)
        at = 0
        for name, shape in shapes.items():
            n = math.prod(shape)
            self.spans[name] = (at, n)
            at += n
        self.size = at

    def views(self, flat: np.ndarray | torch.Tensor) -> dict:
        """Each array as a view of ``flat`` in its shape."""
        return {k: flat[o:o + n].reshape(self.shapes[k]) for k, (o, n) in self.spans.items()}
