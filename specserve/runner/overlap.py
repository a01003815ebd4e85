"""The overlap scheduler's device side: step n+1 is staged and launched before the host has step n's result.

The scheduler stages a row that continues a request of the step in flight (a *dependent* row) as if that step
accepted every draft: its first position, KV slots and draft count are the largest they can be, and its tokens
are placeholders. Every step writes its result rows into ``StepCarry``, a device buffer with one row per column of
the engine's step (a request's index in that step's schedule), and the next step, before it expands its record,
corrects its dependent rows from there (``correct_record``): with ``a`` of the ``prev_nd`` drafts accepted, the
row starts ``prev_nd - a`` positions earlier, its tokens are the bonus and the new drafts (a draft tree's nodes,
its parents too), its draft count is what the row's room allows then (a tree's: its nodes whose depth fits), its
sampling offsets move back by the same amount and its thinking phase follows the tokens emitted. The host's copy of a step's result rows comes back through pinned buffers used in
turn (``copy_back``), while the next step runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class CarryCopy:
    """A step's result rows on their way to the host (``StepCarry.copy_back``)."""

    host: torch.Tensor  # [b, C] int64, a view of a pinned buffer
    event: torch.cuda.Event | None  # recorded after the copy (CUDA); None on the CPU, where it has run
    logprobs: torch.Tensor | None = None  # [b, F] float32: the rows' log-probabilities, where the step has any


class StepCarry:
    """Result rows of the last step by engine-step column, on the device: [columns + 1, C] int64 with C = 2D + 2
    speculating (accepted count, emitted tokens D + 1, next drafts D) or 1 (the sampled token); the last row
    takes the padding rows' results."""

    def __init__(self, columns: int, width: int, float_width: int, device: torch.device) -> None:
        self.columns, self.width = columns, width
        self.buf = torch.zeros(columns + 1, width, dtype=torch.int64, device=device)
        # the emitted tokens' log-probabilities (``sampler.token_logprobs``), for steps where a row asks for them
        self.fbuf = torch.zeros(columns + 1, float_width, dtype=torch.float32, device=device)
        pin = device.type == "cuda"
        # two: the host reads step n's rows while step n + 1's copy fills the other
        self._host = [torch.empty(columns, width, dtype=torch.int64, pin_memory=pin) for _ in range(2)]
        self._fhost = [torch.empty(columns, float_width, dtype=torch.float32, pin_memory=pin) for _ in range(2)]
        self._turn = 0

    @property
    def scratch(self) -> int:
        """The column of padding rows."""
        return self.columns

    def publish(self, out, dst: torch.Tensor) -> None:
        """Inside a step: its result (speculator rows [C, B], or sampled tokens [B]; with log-probabilities, a pair
        whose second is [B, F] or, a plain step's, [B, F'] with F' <= F) into the rows ``dst`` [B]. A speculative
        engine's plain step (one that verified and drafted nothing) writes its tokens as a speculator's rows that
        accepted nothing: 0, then the token (the emitted tokens after it and the drafts are never read)."""
        if isinstance(out, tuple):
            out, lps = out
            self.fbuf[:, :lps.shape[1]].index_copy_(0, dst, lps)
        if out.dim() == 1:
            out = out[:, None] if self.width == 1 else torch.nn.functional.pad(out[:, None], (1, 0))  # [B, 1 or 2]
        else:
            out = out.t()
        self.buf[:, :out.shape[1]].index_copy_(0, dst, out)

    def copy_back(self, n: int, logprobs: bool = False) -> CarryCopy:
        """Queue the copy of columns [0, n) to the host (their log-probabilities too, where ``logprobs``), after
        everything queued so far."""
        self._turn ^= 1
        host = self._host[self._turn][:n]
        host.copy_(self.buf[:n], non_blocking=True)
        lps = None
        if logprobs:
            lps = self._fhost[self._turn][:n]
            lps.copy_(self.fbuf[:n], non_blocking=True)
        event = None
        if self.buf.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        return CarryCopy(host, event, lps)

    @staticmethod
    def read(copy: CarryCopy) -> tuple[list[list[int]], list[list[float]] | None]:
        """Wait for a copy -> its rows [b][C] and their log-probabilities [b][F] (or None) as Python lists."""
        if copy.event is not None:
            copy.event.synchronize()
        return copy.host.tolist(), None if copy.logprobs is None else copy.logprobs.tolist()


def overlap_fields(sched, rows: int, draft_len: int, scratch: int, num_nodes: int = 0) -> dict[str, list[int]]:
    """A graph step's record fields for the overlap scheduler, [B] each: ``dst`` every row's carry column; ``src``
    the carry column of the step in flight that a dependent row continues (-1: none); speculating (D =
    ``draft_len``; a draft tree's ``num_nodes`` N, a chain's D), ``prev_nd`` the drafts that step verifies for
    it, ``room`` its room for drafts were every draft accepted (``max_total_tokens - known - 1``, unclamped) and
    ``cap`` the drafts the step's token budget left it."""
    out = dict(dst=[s.column for s in sched] + [scratch] * (rows - len(sched)),
               src=[s.after.column if s.after is not None else -1 for s in sched] + [-1] * (rows - len(sched)))
    if draft_len:
        n = max(num_nodes, draft_len)
        prev, room, cap = [], [], []
        for s in sched:
            r = s.request.max_total_tokens - (s.start + s.num_tokens - s.num_drafts) - 1
            # the drafts the step in flight proposes it (a chain's draft length may vary by step; a tree's N)
            planned = s.after.next_drafts if s.after is not None and s.after.next_drafts >= 0 else n
            full = min(planned, max(0, r))  # the drafts it gets unless the budget cut them
            full = planned if full and planned > draft_len else full  # a tree's: its largest count
            prev.append(s.after.num_drafts if s.after is not None else 0)
            room.append(r)
            cap.append(s.num_drafts if s.num_drafts < full else planned)
        pad = [0] * (rows - len(sched))
        out.update(prev_nd=prev + pad, room=room + pad, cap=cap + pad)
    return out


def output_offsets(sched, rows: int) -> list[int]:
    """Each row's output index of the first token it samples, the step in flight assumed to accept every draft
    (``correct_record`` moves it back); padding rows 0."""
    return ([s.start + s.num_tokens - s.num_drafts - s.request.num_prompt_tokens for s in sched]
            + [0] * (rows - len(sched)))
