"""Speculative-decoding counters, per request and global (SPEC.md section 6)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import NamedTuple


class Verified(NamedTuple):
    """One row's verify step, as counted (``SpecStats.record``); a step's rows are tallied by it (``tally``), since
    many rows of a large batch verify alike and the engine-wide counts then move once per kind of row."""

    num_drafts: int  # drafts verified
    num_accepted: int  # of those, accepted
    num_emitted: int  # tokens emitted
    depth: int | None = None  # a draft tree's depth (a chain: None)


Tally = Counter  # Verified -> rows of a step that verified so


@dataclass
class SpecStats:
    """Counts over verify steps (steps that checked at least one draft).

    acceptance rate = accepted / drafted; acceptance length = emitted / verify steps (the bonus token
    included, so 1.0 means no draft was ever accepted); per-position acceptance = how often draft j was
    accepted when drafted (with draft trees: how often the accepted path reached depth j + 1 when the tree
    did; a tree's acceptance rate counts every node it verified).
    """

    num_drafted: int = 0
    num_accepted: int = 0
    num_verify_steps: int = 0
    num_emitted: int = 0
    drafted_per_pos: list[int] = field(default_factory=list)
    accepted_per_pos: list[int] = field(default_factory=list)
    # steps launched by the drafts they proposed a row (index: the draft length; a tree's steps count its nodes), and
    # the same in launch order, run-length encoded as [draft length, steps]
    steps_by_draft_len: list[int] = field(default_factory=list)
    draft_len_history: list[list[int]] = field(default_factory=list)

    def record_step(self, draft_len: int) -> None:
        """One speculative step launched, proposing ``draft_len`` drafts a row."""
        grow = draft_len + 1 - len(self.steps_by_draft_len)
        if grow > 0:
            self.steps_by_draft_len += [0] * grow
        self.steps_by_draft_len[draft_len] += 1
        if self.draft_len_history and self.draft_len_history[-1][0] == draft_len:
            self.draft_len_history[-1][1] += 1
        else:
            self.draft_len_history.append([draft_len, 1])

    def record(self, num_drafts: int, num_accepted: int, num_emitted: int, depth: int | None = None,
               times: int = 1) -> None:
        """``times`` rows' verify steps alike: drafts verified, of them accepted, tokens emitted; ``depth``: a draft
        tree's depth, whose positions are its depths (a chain's are its drafts)."""
        if num_drafts <= 0:
            return
        self.num_drafted += num_drafts * times
        self.num_accepted += num_accepted * times
        self.num_verify_steps += times
        self.num_emitted += num_emitted * times
        positions = num_drafts if depth is None else depth
        grow = positions - len(self.drafted_per_pos)
        if grow > 0:
            self.drafted_per_pos += [0] * grow
            self.accepted_per_pos += [0] * grow
        for j in range(positions):
            self.drafted_per_pos[j] += times
            if j < num_accepted:
                self.accepted_per_pos[j] += times

    def record_tally(self, tally: "Tally[Verified]") -> None:
        """A step's rows, tallied by how they verified."""
        for v, n in tally.items():
            self.record(*v, times=n)

    @property
    def acceptance_rate(self) -> float | None:
        return self.num_accepted / self.num_drafted if self.num_drafted else None

    @property
    def acceptance_length(self) -> float | None:
        return self.num_emitted / self.num_verify_steps if self.num_verify_steps else None

    @property
    def per_position(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_pos, self.drafted_per_pos)]

    def as_dict(self) -> dict:
        return {"drafted": self.num_drafted, "accepted": self.num_accepted,
                "verify_steps": self.num_verify_steps, "emitted": self.num_emitted,
                "acceptance_rate": self.acceptance_rate, "acceptance_length": self.acceptance_length,
                "per_position_acceptance": self.per_position, "steps_by_draft_len": self.steps_by_draft_len,
                "draft_len_history": self.draft_len_history}

    def summary(self) -> str:
        if not self.num_verify_steps:
            return "speculation: no drafts verified"
        pos = " ".join(f"{p:.2f}" for p in self.per_position)
        return (f"drafted {self.num_drafted}, accepted {self.num_accepted} "
                f"(rate {self.acceptance_rate:.2%}), acceptance length {self.acceptance_length:.2f} "
                f"over {self.num_verify_steps} verify steps, per position [{pos}]")
