"""A request's host-side state and the result objects returned to users."""

from __future__ import annotations

import enum
import random
import time
from dataclasses import dataclass, field

from specserve.core.metrics import SpecStats
from specserve.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0

    @property
    def ttft(self) -> float | None:
        """Seconds from arrival to the first generated token."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    def tpot(self, num_tokens: int) -> float | None:
        """Mean seconds per output token after the first."""
        if self.finished_time is None or self.first_token_time is None or num_tokens < 2:
            return None
        return (self.finished_time - self.first_token_time) / (num_tokens - 1)

    @property
    def queue(self) -> float | None:
        """Seconds from arrival until the scheduler first ran the request, or held it with a slot free for a prefix
        another request was computing (waiting for a free slot; the hold is the request's own: its TTFT)."""
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def e2e(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time


class Request:
    """One generation request. ``token_ids`` holds prompt then output tokens; ``num_computed_tokens``
    of them have KV in ``block_ids``. After a preemption ``num_computed_tokens`` is 0 and the request
    recomputes prompt + output so far before sampling again."""

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
                 max_total_tokens: int, eos_token_ids: tuple[int, ...],
                 thinking_tokens: tuple[int, int] = (-1, -1)) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.num_prompt_tokens = len(prompt_token_ids)
        self.token_ids: list[int] = list(prompt_token_ids)
        # the prompt as every output reports it: one list for the request's life, not a copy per step (a
        # 2,000-token prompt copied for each of 64 rows costs ~0.3 ms of every step)
        self.prompt_token_ids: list[int] = self.token_ids[:self.num_prompt_tokens]
        self.params = params
        # Every request gets a seed so that sampling is a pure function of (seed, output index).
        self.seed = params.seed if params.seed is not None else random.getrandbits(31)
        self.max_total_tokens = max_total_tokens
        self.stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
        self.num_computed_tokens = 0
        self.block_ids: list[int] = []
        self.spec_token_ids: list[int] = []  # drafts proposed by the last step, verified by the next
        self.spec_parents: list[int] | None = None  # a draft tree's parent columns (0: the last token); None: a chain
        # overlap scheduler: its row (a ``ScheduledRequest``) in the latest step launched and not yet collected
        self.in_flight = None
        # prefix caching: its full blocks' keys so far (``cache.kv_cache.block_keys``) and how many of its blocks are
        # registered in the pool
        self.block_keys: list[int] = []
        self.num_registered = 0
        # per output token, where asked: its log-probabilities (``Logprob`` dicts), and the rows of the tokens
        # appended since the last report (``sampler.token_logprobs``)
        self.logprobs: list[dict[int, Logprob]] | None = [] if params.logprobs is not None else None
        self.logprob_rows: list[list[float]] = []
        # n > 1: the completions of one prompt (``Family``), this one's index among them, and for the first, those
        # that wait to fork its prompt's KV once it is computed
        self.family: Family | None = None
        self.index = 0
        self.followers: list[Request] = []
        self.spec_stats = SpecStats()
        # thinking phase after the last known token (relaxed acceptance): the last begin/end token wins
        self.thinking_tokens = thinking_tokens
        self.thinking = False
        if max(thinking_tokens) >= 0:  # the prompt's last begin or end token (not a Python call per prompt token)
            last = next((t for t in reversed(self.prompt_token_ids) if t in thinking_tokens), None)
            if last is not None:
                self._track_thinking(last)
        self.status = RequestStatus.WAITING
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.metrics = RequestMetrics(arrival_time=time.perf_counter())
        self.detokenizer = None  # set by the engine
        self.output_text = ""
        self.text_sent = 0  # characters of output_text reported as delta_text so far
        self.error: str | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def finish(self, reason: str, stop_reason: int | str | None = None) -> None:
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason
        self.metrics.finished_time = time.perf_counter()

    def _track_thinking(self, token: int) -> None:
        if token == self.thinking_tokens[0]:
            self.thinking = True
        elif token == self.thinking_tokens[1]:
            self.thinking = False

    def append_token(self, token: int) -> None:
        """Add one generated token and finish the request if it ends generation."""
        self.append_tokens([token])

    def append_tokens(self, tokens: list[int]) -> int:
        """Add a step's generated tokens in order, up to the first that ends generation (a stop token, the
        ``max_tokens``-th output token, or the ``max_total_tokens``-th token), finishing the request there -> how
        many were added. One call a row a step instead of one a token: at many rows the host's step is such
        per-row work."""
        if not tokens:
            return 0
        if self.metrics.first_token_time is None:
            self.metrics.first_token_time = time.perf_counter()
        room = self.max_total_tokens - len(self.token_ids)  # tokens until the length limit (at least the one)
        if self.params.max_tokens is not None:
            room = min(room, self.params.max_tokens - self.num_output_tokens)
        n = min(len(tokens), max(room, 1))
        stops = self.stop_ids
        stop = next((i for i in range(n) if tokens[i] in stops), None) if stops else None
        if stop is not None:
            n = stop + 1
        new = tokens[:n] if n < len(tokens) else tokens
        self.token_ids.extend(new)
        if max(self.thinking_tokens) >= 0:
            for tok in new:
                self._track_thinking(tok)
        if stop is not None:
            tok = new[-1]
            self.finish("stop", None if tok not in self.params.stop_token_ids else tok)
        elif n >= room:
            self.finish("length")
        return n


@dataclass
class Family:
    """The ``n`` completions of one request (``SamplingParams.n``), each a ``Request`` of its own."""

    request_id: str  # the id the user knows
    members: list  # the completions' requests, by index

    @property
    def finished(self) -> bool:
        return all(m.finished for m in self.members)


@dataclass
class Logprob:
    """A token's log-probability under the target's distribution at its position (vLLM's ``Logprob``)."""

    logprob: float
    rank: int | None = None  # 1: the most likely token there
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: int | str | None = None
    # per output token (where the request asked, ``SamplingParams.logprobs``): the token and the most likely ones
    logprobs: list[dict[int, Logprob]] | None = None


@dataclass
class RequestOutput:
    """What the engine reports for a request (vLLM's shape: ``outputs[0].text``; shortcuts on the object)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    spec: SpecStats | None = None  # speculative-decoding counters (None when speculation is off)
    error: str | None = None
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    delta_index: int = 0  # the completion the deltas belong to (n > 1)

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    def timings(self) -> dict:
        m = self.metrics
        if m is None:
            return {}
        return {"ttft_s": m.ttft, "tpot_s": m.tpot(len(self.token_ids)), "e2e_s": m.e2e, "queue_s": m.queue,
                "num_preemptions": m.num_preemptions}

    def spec_metrics(self) -> dict | None:
        return None if self.spec is None else self.spec.as_dict()
