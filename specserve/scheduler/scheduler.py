"""Continuous batching with chunked prefill and preemption by recompute.

Every request is scheduled the same way: it needs ``num_tokens - num_computed_tokens`` tokens of
compute (a whole prompt, a chunk of one, or a single decode token) and gets as many as the step's
token budget allows. A request samples a token in a step only when the step finishes its tokens, so a
non-final prefill chunk samples nothing. Running requests go first (oldest first), then waiting ones;
when the pool cannot hold the next slots, the newest running request is preempted: its blocks are
freed and it goes back to the front of the queue to recompute prompt + output so far.

Under the overlap scheduler a step is scheduled while the one before it still runs: a request with a row in that
step (``Request.in_flight``) is scheduled as if the step accepted every draft (``_view``), and its new row says
which row it continues (``after``) for the device to correct (``runner/overlap.py``); the engine sets the row's
true start and draft count once the step before is collected (``rebase``). A request the step in flight is certain
to finish (by length) is not scheduled again.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple

from specserve.cache.kv_cache import BlockPool, block_keys
from specserve.config import SchedulerConfig
from specserve.core.request import Request, RequestStatus

log = logging.getLogger("specserve")


@dataclass
class ScheduledRequest:
    request: Request
    start: int  # first position computed this step (= num_computed_tokens before the step)
    num_tokens: int  # tokens computed this step (known tokens, then ``num_drafts`` drafts)
    sample: bool  # the step reaches the end of the request's known tokens and samples the next one(s)
    num_drafts: int = 0  # drafts of the previous step verified in this one
    column: int = -1  # index in its step's schedule
    # the row of the step in flight this one continues (overlap scheduler): until that step is collected, start,
    # num_tokens and num_drafts assume it accepted every draft
    after: ScheduledRequest | None = None
    discard: bool = False  # the request finished or was preempted before this row's step was collected
    next_drafts: int = -1  # the drafts its step proposes for the next at most (set at launch; -1: not known)
    cut: bool = False  # the step's token budget left it fewer drafts than it had: it verifies at most num_drafts

    def rebase(self) -> None:
        """The row it continues has been collected: start and drafts as the request now has them, at most as many
        drafts as the budget left it (the device corrected the step's inputs to the same: ``cap``,
        ``runner/overlap.py``)."""
        req = self.request
        self.start = req.num_computed_tokens
        self.num_drafts = min(len(req.spec_token_ids), self.num_drafts) if self.cut else len(req.spec_token_ids)
        self.num_tokens = req.num_tokens - req.num_computed_tokens + self.num_drafts
        self.after = None


class RowView(NamedTuple):
    """A request as the next step sees it (``Scheduler._view``)."""

    computed: int  # tokens in the KV cache
    known: int  # tokens known
    drafts: int  # drafts to verify
    after: ScheduledRequest | None  # its row in the step in flight, when that row samples

    @property
    def need(self) -> int:
        """Tokens to compute: the known ones not yet in the KV cache, plus drafts to verify."""
        return self.known - self.computed + self.drafts


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def total_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, pool: BlockPool, key_after: int = 0) -> None:
        self.cfg = cfg
        self.pool = pool
        # prefix caching: tokens past a block that its KV depends on (a draft head's KV at a position reads the
        # tokens after it: one for EAGLE-3 and MTP-Eagle, a module each for vanilla MTP), part of its key
        self.key_after = key_after
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def _view(self, req: Request) -> RowView:
        """The request's tokens in the KV cache, tokens known and drafts to verify as they will be after the step
        in flight if it accepts every draft; ``after`` its row when that row samples (the device corrects the next
        row from its result). Computed once per row and step: nothing the schedule does to other requests changes
        it."""
        e = req.in_flight
        if e is None or e.discard:
            return RowView(req.num_computed_tokens, len(req.token_ids), len(req.spec_token_ids), None)
        computed = e.start + e.num_tokens
        if not e.sample:  # a prompt chunk: nothing sampled, nothing to correct
            return RowView(computed, len(req.token_ids), 0, None)
        known = computed + 1  # accepted drafts and the bonus
        planned = e.next_drafts if e.next_drafts >= 0 else self.cfg.max_draft_len  # what its step drafts
        drafts = min(planned, max(0, req.max_total_tokens - known - 1))
        if drafts and self.cfg.num_verify_drafts > self.cfg.max_draft_len:
            # a tree's nodes under a room limit are known on the device only: the most its step drafts
            drafts = planned if e.next_drafts >= 0 else self.cfg.num_verify_drafts
        return RowView(computed, known, drafts, e)

    @staticmethod
    def _ends_in_flight(req: Request) -> bool:
        """The step in flight ends the request whatever it accepts (it reaches the request's last token)."""
        e = req.in_flight
        return (e is not None and not e.discard and e.sample
                and e.start + e.num_tokens - e.num_drafts + 1 >= req.max_total_tokens)

    def _slots(self, v: RowView, n: int) -> int:
        """KV slots a row needs to compute ``n`` tokens from view ``v``."""
        end = v.computed + n
        # a step that reaches the end of the known tokens also writes the draft loop's slots past them
        return end + (self.cfg.num_lookahead_slots if end >= v.known else 0)

    @staticmethod
    def _entry(req: Request, v: RowView, n: int, column: int) -> ScheduledRequest:
        k = v.known - v.computed
        return ScheduledRequest(req, v.computed, n, n >= k, max(0, n - k), column, v.after, cut=k <= n < k + v.drafts)

    def _preempt(self, req: Request) -> None:
        self.pool.free(req.block_ids)  # registered blocks stay cached: it may find them again
        req.num_registered = 0
        if req.in_flight is not None:  # its row in the step in flight is dropped when collected
            req.in_flight.discard = True
            req.in_flight = None
        req.num_computed_tokens = 0
        req.spec_token_ids, req.spec_parents = [], None
        req.status = RequestStatus.WAITING
        req.metrics.num_preemptions += 1
        self.waiting.appendleft(req)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.cfg.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if self._ends_in_flight(req):
                i += 1
                continue
            v = self._view(req)
            n = min(v.need, budget)
            slots = self._slots(v, n)
            while not self.pool.try_reserve(req.block_ids, slots):
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
            else:
                out.scheduled.append(self._entry(req, v, n, len(out.scheduled)))
                budget -= n
                i += 1
                continue
            break  # the request itself was preempted: nothing newer can run either
        if not out.preempted:
            computing: set[int] | None = None  # keys of the blocks running requests compute (built when asked)
            held = []  # waiting requests that wait for a prefix another request is computing, each holding a slot
            admitted = 0  # requests admitted from the queue in this step
            while self.waiting and budget > 0 and len(self.running) + len(held) < self.cfg.max_num_seqs:
                req = self.waiting[0]
                # ``whole_prompts_together``: a request another admitted in this step would have to cut waits, first
                # in line for the next step (the burst's rows then all end their prompts: one prefill graph)
                defer = admitted and self.cfg.whole_prompts_together
                fresh = req.num_computed_tokens == 0 and not req.block_ids  # starts from nothing
                if fresh:
                    if self.pool.caching and self.running:
                        if computing is None:
                            computing = self._computing()
                        if self._waits_for_prefix(req, computing):
                            if req.metrics.first_scheduled_time is None:  # it had a slot: the wait is its own
                                req.metrics.first_scheduled_time = time.perf_counter()
                            held.append(self.waiting.popleft())
                            continue
                    if defer and self._uncached_need(req) > budget:
                        break
                    self._take_cached(req)
                v = self._view(req)
                n = min(v.need, budget)
                if defer and not fresh and n < v.need:  # (a fresh request was judged before it took cached blocks)
                    break
                slots = self._slots(v, n)
                if not self.pool.try_reserve(req.block_ids, slots):
                    self.pool.free(req.block_ids)  # the cached blocks too: taken again when it fits
                    req.num_computed_tokens = 0
                    break
                self.waiting.popleft()
                req.status = RequestStatus.RUNNING
                if req.metrics.first_scheduled_time is None:
                    req.metrics.first_scheduled_time = time.perf_counter()
                self.running.append(req)
                out.scheduled.append(self._entry(req, v, n, len(out.scheduled)))
                budget -= n
                admitted += 1
                if computing is not None:
                    computing.update(self._uncached_keys(req))
            self.waiting.extendleft(reversed(held))  # first in line again, in their order
        return out

    def _uncached_keys(self, req: Request) -> list[int]:
        """Prefix caching: the keys of the request's full blocks of known tokens not registered yet (those it is
        computing)."""
        keys = block_keys(req.block_keys, req.token_ids, self.pool.block_size, self.key_after)
        return keys[req.num_registered:]

    def _computing(self) -> set[int]:
        """Prefix caching: the keys of the blocks running requests are computing."""
        out: set[int] = set()
        for req in self.running:
            out.update(self._uncached_keys(req))
        return out

    def _waits_for_prefix(self, req: Request, computing: set[int]) -> bool:
        """Whether a request starting from nothing should wait: the first of its prompt's blocks that is not
        cached is one a running request is computing. Admitted now, it would compute that prefix again beside
        it (many requests over one new document, arriving together); a step or a few later it takes it cached
        (SGLang schedules by shared prefix for the same reason; vLLM computes it in each)."""
        keys, usable = self._prompt_keys(req)
        m = self.pool.cached_run(keys, usable)
        return m < usable and keys[m] in computing

    def _prompt_keys(self, req: Request) -> tuple[list[int], int]:
        """Prefix caching: the request's block keys and how many of them a request starting from nothing may take
        cached (at least one token is left to compute: the step that computes it samples)."""
        keys = block_keys(req.block_keys, req.token_ids, self.pool.block_size, self.key_after)
        return keys, max(0, (req.num_tokens - max(self.key_after, 1)) // self.pool.block_size)

    def _uncached_need(self, req: Request) -> int:
        """The tokens a request starting from nothing would compute, after the cached blocks ``_take_cached`` would
        give it (nothing taken)."""
        if not self.pool.caching:
            return req.num_tokens
        keys, usable = self._prompt_keys(req)
        return req.num_tokens - self.pool.cached_run(keys, usable) * self.pool.block_size

    def _take_cached(self, req: Request) -> None:
        """Prefix caching: a request starting from nothing takes the cached blocks its tokens begin with
        (``_prompt_keys``)."""
        if not self.pool.caching:
            return
        keys, usable = self._prompt_keys(req)
        req.block_ids = self.pool.match(keys[:usable])
        req.num_registered = len(req.block_ids)
        req.num_computed_tokens = len(req.block_ids) * self.pool.block_size

    def cache_blocks(self, req: Request) -> None:
        """Prefix caching: register the request's full blocks whose KV is computed and whose key's tokens are
        known (called after each of its steps is collected, and before it finishes)."""
        if not self.pool.caching or req.num_computed_tokens // self.pool.block_size <= req.num_registered:
            return  # no full block computed since the last call (most steps of a generating request)
        keys = block_keys(req.block_keys, req.token_ids, self.pool.block_size, self.key_after)
        n = min(len(keys), req.num_computed_tokens // self.pool.block_size, len(req.block_ids))
        if n > req.num_registered:
            self.pool.register(req.block_ids[req.num_registered:n], keys[req.num_registered:n])
            req.num_registered = n

    def fork_when_ready(self, leader: Request, follower: Request) -> None:
        """n > 1: ``follower`` starts once ``leader`` (the same prompt) has its prompt's KV, sharing its full
        prompt blocks (``_release_followers``)."""
        leader.followers.append(follower)

    def _release_followers(self, leader: Request, share: bool) -> None:
        """The leader's prompt is computed (``share``: its full prompt blocks, but for those whose KV reads tokens
        past the prompt, are held by each follower too) or the leader is gone: its followers join the queue's
        front, in order."""
        bs = self.pool.block_size
        k = max(0, (leader.num_prompt_tokens - max(self.key_after, 1)) // bs) if share else 0
        shared = leader.block_ids[:k]
        for f in reversed(leader.followers):
            if f.finished:  # aborted with its family
                continue
            f.block_ids = self.pool.share(shared)
            f.num_computed_tokens = len(shared) * bs
            self.waiting.appendleft(f)
        leader.followers = []

    def update(self, out: SchedulerOutput, results: list) -> list[tuple[ScheduledRequest, object]]:
        """Advance computed lengths from a step's results (one ``RowResult`` per scheduled request): the KV
        of known tokens and accepted drafts becomes computed, and rejected drafts are dropped by length
        alone (the next step overwrites their slots). Returns the (entry, result) pairs of the rows that
        sampled, for the engine to append tokens in order."""
        sampled = []
        for s, r in zip(out.scheduled, results):
            if s.discard:
                continue
            req = s.request
            req.num_computed_tokens += s.num_tokens - s.num_drafts + r.num_accepted
            if req.followers and req.num_computed_tokens >= req.num_prompt_tokens:
                self._release_followers(req, share=True)
            if s.sample:
                sampled.append((s, r))
        return sampled

    def finish(self, req: Request) -> None:
        """Release a finished (or aborted) request's blocks and drop it from the queues (followers still waiting
        for its prompt start on their own)."""
        if req.followers:
            self._release_followers(req, share=False)
        self.pool.free(req.block_ids)
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
