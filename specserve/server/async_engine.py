"""An asyncio front for ``LLMEngine``: the engine steps in its own thread; requests and aborts reach it
through a command queue, and each request's outputs come back on its own stream (``_Stream``)."""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
from collections import deque

from specserve.core.request import RequestOutput
from specserve.engine.llm_engine import LLMEngine
from specserve.sampling_params import SamplingParams

log = logging.getLogger("specserve")


class QueueFull(Exception):
    """More requests are waiting than the server accepts."""


class ShuttingDown(Exception):
    """The server is shutting down: the request was ended (after the drain grace) or not admitted."""


class EngineFailed(Exception):
    """An engine step failed; every request in flight is ended with this error."""


class _Stream:
    """One request's outputs (or the exception that ends it), filled on its event loop's thread. A reader that
    fell behind gets the outputs waiting for it as one (``get``): under load a client then receives a step's
    worth of tokens per chunk instead of one chunk a step, and the event loop formats fewer chunks."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.items: deque = deque()
        self.ready = asyncio.Event()

    def put(self, item) -> None:
        """From any thread."""
        self.loop.call_soon_threadsafe(self.push, item)

    def push(self, item) -> None:
        """On the loop's thread."""
        self.items.append(item)
        self.ready.set()

    async def get(self):
        while not self.items:
            self.ready.clear()
            await self.ready.wait()
        item = self.items.popleft()
        while (isinstance(item, RequestOutput) and not item.finished and self.items
               and isinstance(self.items[0], RequestOutput) and self.items[0].delta_index == item.delta_index):
            later = self.items.popleft()  # cumulative: the later output, with both steps' deltas
            later.delta_text = item.delta_text + later.delta_text
            later.delta_token_ids = item.delta_token_ids + later.delta_token_ids
            item = later
        return item


def _deliver(batch: list[tuple[_Stream, RequestOutput]]) -> None:
    for stream, item in batch:
        stream.push(item)


class AsyncEngine:
    def __init__(self, engine: LLMEngine, max_queue: int = 256) -> None:
        self.engine = engine
        self.max_queue = max_queue
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, _Stream] = {}
        self._ids = itertools.count()
        self._stop = threading.Event()
        self._pending = 0  # submitted but not finished
        self._lock = threading.Lock()
        self.closing = False  # set when the drain begins: new requests are refused
        # the prompt tokens admitted, for the periodic throughput log (written by the engine thread only)
        self.prompt_tokens_total = 0
        self._thread = threading.Thread(target=self._loop, name="specserve-engine", daemon=True)
        self._thread.start()

    # --- called from the event loop ------------------------------------------------------------
    async def generate(self, prompt, params: SamplingParams):
        """Async iterator of ``RequestOutput`` for one request; raises ValueError for bad input and
        QueueFull when too many requests wait, ShuttingDown while draining. Cancelling the iteration aborts
        the request. ``prompt`` is best given as token ids (tokenized off the event loop and off the engine
        thread, by the caller): a string is tokenized on the engine thread, stalling every stream."""
        if self.closing:
            raise ShuttingDown("the server is shutting down")
        with self._lock:
            if self._pending >= self.max_queue:
                raise QueueFull(f"{self._pending} requests in flight; the server admits {self.max_queue}")
            self._pending += 1
        rid = f"req-{next(self._ids)}"
        stream = _Stream(asyncio.get_running_loop())
        self._commands.put(("add", rid, prompt, params, stream))
        finished = False
        try:
            while True:
                item = await stream.get()
                if isinstance(item, Exception):
                    finished = True
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            if not finished:
                self._commands.put(("abort", rid))

    def abort_all(self, error: Exception) -> None:
        """End every request in flight with ``error`` (the end of a shutdown's drain)."""
        self._commands.put(("abort_all", error))

    def shutdown(self) -> None:
        self._stop.set()
        self._commands.put(("wake",))
        self._thread.join(timeout=30)

    # --- engine thread ----------------------------------------------------------------------------
    def _loop(self) -> None:
        eng = self.engine
        while not self._stop.is_set():
            block = not eng.has_unfinished_requests()
            while True:
                try:
                    cmd = self._commands.get(block=block, timeout=0.05 if block else None)
                except queue.Empty:
                    break
                block = False
                self._handle(cmd)
            if eng.has_unfinished_requests():
                try:
                    outs = eng.step()
                except Exception as e:  # never leave clients hanging on an engine error
                    log.exception("engine step failed")
                    for rid in list(self._streams):
                        eng.abort_request(rid)
                        self._finish(rid, EngineFailed(f"engine error: {type(e).__name__}: {e}"))
                    continue
                # a step's outputs reach each event loop in one call (one wake-up, not one a request)
                by_loop: dict[asyncio.AbstractEventLoop, list] = {}
                for out in outs:
                    stream = self._streams.get(out.request_id)
                    if stream is not None:
                        by_loop.setdefault(stream.loop, []).append((stream, out))
                        if out.finished:
                            self._finish(out.request_id)
                for loop, batch in by_loop.items():
                    loop.call_soon_threadsafe(_deliver, batch)
        for rid in list(self._streams):  # shutting down: cancel what is left
            eng.abort_request(rid)
            self._finish(rid, ShuttingDown("the server is shutting down"))

    def _handle(self, cmd) -> None:
        kind = cmd[0]
        if kind == "add":
            _, rid, prompt, params, stream = cmd
            try:
                self.engine.add_request(prompt, params, request_id=rid)
            except ValueError as e:
                self._release()
                stream.put(e)
                return
            self._streams[rid] = stream
            self.prompt_tokens_total += len(prompt) if not isinstance(prompt, str) else 0
        elif kind == "abort_all":
            for rid in list(self._streams):
                self.engine.abort_request(rid)
                self._finish(rid, cmd[1])
        elif kind == "abort":
            rid = cmd[1]
            if rid in self._streams:
                self.engine.abort_request(rid)
                del self._streams[rid]
                self._release()

    def _release(self) -> None:
        with self._lock:
            self._pending -= 1

    @property
    def generated_tokens_total(self) -> int:
        """Tokens the engine appended to requests (counted there: a request that does not stream reports once)."""
        return self.engine.num_generated_tokens

    @property
    def num_pending(self) -> int:
        return self._pending

    def _finish(self, rid: str, error: Exception | None = None) -> None:
        stream = self._streams.pop(rid, None)
        if stream is not None:
            self._release()
            if error is not None:
                stream.put(error)


def usage_of(out: RequestOutput) -> dict:
    done = sum(len(c.token_ids) for c in out.outputs)  # every completion's (n > 1)
    u = {"prompt_tokens": len(out.prompt_token_ids), "completion_tokens": done,
         "total_tokens": len(out.prompt_token_ids) + done}
    if out.spec is not None:
        u["spec"] = {"drafted": out.spec.num_drafted, "accepted": out.spec.num_accepted,
                     "acceptance_length": out.spec.acceptance_length}
    return u
