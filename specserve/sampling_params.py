"""Per-request sampling parameters, in vLLM's shape."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

_TOPK_MAX = 2 ** 31 - 1  # past any vocabulary: top-k keeps every token
MAX_LOGPROBS = 20  # most likely tokens reported per position (OpenAI's top_logprobs limit)
MAX_N = 128  # completions per prompt (OpenAI's limit)


class RequestOutputKind(enum.IntEnum):
    """Which steps report a request (vLLM's names): ``CUMULATIVE``, every step that produced tokens (its output
    holds the whole reply so far, and the step's ``delta_text`` / ``delta_token_ids``); ``FINAL_ONLY``, only the
    step that finishes it, which spares the engine detokenizing and building an output for every row at every
    step (``LLM.generate`` asks for it). vLLM's ``DELTA`` is not offered: a cumulative output carries the deltas.
    A FINAL_ONLY text is the tokenizer's decode of the whole reply; with a tokenizer whose decode cleans up spaces
    around punctuation, text decoded step by step (CUMULATIVE) can differ from it there."""

    CUMULATIVE = 0
    FINAL_ONLY = 2


@dataclass
class SamplingParams:
    """How one request is decoded.

    ``temperature == 0`` is greedy. ``top_k <= 0`` (or -1) disables top-k; ``top_p == 1`` and
    ``min_p == 0`` disable those filters (a ``top_k`` past the vocabulary keeps every token). A ``seed``
    (any integer, taken modulo 2**64) makes sampling reproducible whatever else shares the batch; with ``n``
    completions per prompt, completion i samples with seed + i (the first is the n=1 request's), and they share
    the prompt's KV (computed once, then forked). Generation stops at EOS (unless
    ``ignore_eos``), at any of ``stop_token_ids``, when the text contains one of ``stop`` (the text is cut
    before it unless ``include_stop_str_in_output``), or after ``max_tokens`` tokens.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # log-probabilities of each generated token under the target's distribution (its logits' softmax), and of the
    # ``logprobs`` most likely tokens at that position (0: the generated token's only); None: none
    logprobs: int | None = None
    # speculative decoding, per request (None: the engine's SpeculativeConfig decides)
    relaxed_acceptance: bool | None = None
    relaxed_topk: int | None = None
    relaxed_delta: float | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()
        # the device keeps these as int64: larger values are brought into range without changing their meaning
        self.seed = None if self.seed is None else (self.seed + 2 ** 63) % 2 ** 64 - 2 ** 63
        self.top_k = min(self.top_k, _TOPK_MAX)
        self.relaxed_topk = None if self.relaxed_topk is None else min(self.relaxed_topk, _TOPK_MAX)

    def validate(self) -> None:
        def bad(field_name: str, why: str):
            raise ValueError(f"invalid sampling parameter {field_name}={getattr(self, field_name)!r}: {why}")

        def number(v) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool)

        def integer(v) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        if not integer(self.n) or not 1 <= self.n <= MAX_N:
            bad("n", f"must be an integer in [1, {MAX_N}]")
        if not number(self.temperature) or self.temperature < 0 or self.temperature != self.temperature:
            bad("temperature", "must be a number >= 0 (0 means greedy)")
        if not number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            bad("top_p", "must be a number in (0, 1]")
        if not integer(self.top_k) or (self.top_k < -1):
            bad("top_k", "must be an integer >= 1, or 0 / -1 to disable")
        if not number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            bad("min_p", "must be a number in [0, 1]")
        if self.max_tokens is not None and (not integer(self.max_tokens) or self.max_tokens < 1):
            bad("max_tokens", "must be an integer >= 1 (or None for up to the context length)")
        if self.seed is not None and not integer(self.seed):
            bad("seed", "must be an integer")
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop", "stop strings must be non-empty strings")
        if any(not integer(t) or t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "must be non-negative token ids")
        if self.logprobs is not None and (not integer(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            bad("logprobs", f"must be an integer in [0, {MAX_LOGPROBS}] (or None)")
        if self.relaxed_topk is not None and (not integer(self.relaxed_topk) or self.relaxed_topk < 1):
            bad("relaxed_topk", "must be an integer >= 1")
        if self.relaxed_delta is not None and (not number(self.relaxed_delta) or not 0.0 <= self.relaxed_delta <= 1.0):
            bad("relaxed_delta", "must be a number in [0, 1]")
        if not isinstance(self.output_kind, RequestOutputKind):
            bad("output_kind", "must be RequestOutputKind.CUMULATIVE or RequestOutputKind.FINAL_ONLY")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def needs_filter(self) -> bool:
        """Whether top-k / top-p / min-p change the distribution (they need a sort)."""
        return not self.greedy and (self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0)
