"""Per-request sampling parameters, in vLLM's shape."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    """How one request is decoded.

    ``temperature == 0`` is greedy. ``top_k <= 0`` (or -1) disables top-k; ``top_p == 1`` and
    ``min_p == 0`` disable those filters. A ``seed`` makes sampling reproducible whatever else shares
    the batch. Generation stops at EOS (unless ``ignore_eos``), at any of ``stop_token_ids``, when the
    text contains one of ``stop`` (the text is cut before it unless ``include_stop_str_in_output``), or
    after ``max_tokens`` tokens.
    """

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
    # speculative decoding, per request (None: the engine's SpeculativeConfig decides)
    relaxed_acceptance: bool | None = None
    relaxed_topk: int | None = None
    relaxed_delta: float | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()

    def validate(self) -> None:
        def bad(field_name: str, why: str):
            raise ValueError(f"invalid sampling parameter {field_name}={getattr(self, field_name)!r}: {why}")

        if not isinstance(self.temperature, (int, float)) or self.temperature < 0 or self.temperature != self.temperature:
            bad("temperature", "must be a number >= 0 (0 means greedy)")
        if not 0.0 < self.top_p <= 1.0:
            bad("top_p", "must be in (0, 1]")
        if not isinstance(self.top_k, int) or (self.top_k < -1):
            bad("top_k", "must be an integer >= 1, or 0 / -1 to disable")
        if not 0.0 <= self.min_p <= 1.0:
            bad("min_p", "must be in [0, 1]")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            bad("max_tokens", "must be an integer >= 1 (or None for up to the context length)")
        if self.seed is not None and not isinstance(self.seed, int):
            bad("seed", "must be an integer")
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop", "stop strings must be non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "must be non-negative token ids")
        if self.relaxed_topk is not None and (not isinstance(self.relaxed_topk, int) or self.relaxed_topk < 1):
            bad("relaxed_topk", "must be an integer >= 1")
        if self.relaxed_delta is not None and not 0.0 <= self.relaxed_delta <= 1.0:
            bad("relaxed_delta", "must be in [0, 1]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def needs_filter(self) -> bool:
        """Whether top-k / top-p / min-p change the distribution (they need a sort)."""
        return not self.greedy and (self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0)
