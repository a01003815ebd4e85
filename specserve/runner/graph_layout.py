"""The fixed shapes of CUDA-graph steps (``ModelRunner.graph_layout``) and the keys their graphs are kept by."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from specserve.runner.step_batch import StepSwitches


@dataclass(frozen=True)
class GraphLayout:
    """The fixed shape of a CUDA-graph step (``ModelRunner.graph_layout``)."""

    rows: int  # batch size, padded up to a captured size
    q: int  # tokens per row: 1 (decode) or 1 + D (verify), or a prefill's padded token count
    table_width: int  # block-table entries per row (covers max_model_len)
    prefill: bool = False  # rows ending their prompts (``_prefill_layout``), not a generation step, whatever q is
    from_zero: bool = False  # that prefill's rows are whole prompts, from position 0 (``AttentionMetadata.from_zero``)


class GraphKey(NamedTuple):
    """The graph a step replays (``ModelRunner.graph_key``)."""

    layout: GraphLayout
    switches: StepSwitches  # the host switches its code takes
    size: int  # the record's size (the captured copy fixes it)

    @property
    def kind(self) -> tuple[GraphLayout, int, int]:
        """What a choice of draft length, or of tree or chain, asks of the graphs (``CudaGraphs.has``): the layout,
        the drafts the step proposes a row (-1: a plain step, which a speculative engine's steps that verify and
        draft nothing are, or a tree speculator's step) and the children a node expands (a tree speculator's chain
        steps: 1); its other switches follow the requests, not the choice."""
        return self.layout, self.switches.draft_len, self.switches.draft_topk


# padding tokens a prefill layout of several rows may hold past twice its real tokens (``_prefill_layout``), which
# also takes any layout of 16 tokens a row (the least ``prefill_q`` gives: prompts found cached but for their last
# few tokens)
PREFILL_PAD_SLACK = 256


def prefill_q(n: int) -> int:
    """Tokens a row of a prefill graph takes for a prompt's last n tokens: a power of two of at least 16 up to 512,
    past it also three quarters of one (768, 1536, 3072, ...), so that at most a third of a long prompt's graph is
    padding while a handful of graphs serve every length."""
    q = max(16, 1 << (n - 1).bit_length())
    return q // 4 * 3 if q > 512 and n <= q // 4 * 3 else q
