"""Staging buffers: a pinned host buffer and its device twin, the one way a step's host-built inputs reach the
device (one copy per buffer and step; captured CUDA graphs read the device twin in place)."""

from __future__ import annotations

import numpy as np
import torch


class Staging:
    """A pinned host buffer and its device twin; ``upload(n)`` copies the first n elements.

    With ``ring`` > 1 (the overlap scheduler) there are that many host buffers, used in turn: the host writes the
    next step's inputs while the device has not yet copied the last step's, and waits only on the event of the
    copy that last read the buffer it is about to write (a step's uploads are then explicit copies, never captured
    in a graph)."""

    def __init__(self, dtype: torch.dtype, device: torch.device, size: int = 0, ring: int = 1) -> None:
        self.dtype, self.device = dtype, device
        self.ring = ring
        self._hosts: list[torch.Tensor] = [torch.empty(0, dtype=dtype)] * ring
        self._nps = [h.numpy() for h in self._hosts]  # their numpy views (made once: a call costs µs)
        self._events: list[torch.cuda.Event | None] = [None] * ring  # the last copy out of each host buffer
        self._cur = 0  # the host buffer being written
        self.dev = torch.empty(0, dtype=dtype, device=device)
        self._pairs: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}  # (buffer, n) -> slices
        self.generation = 0  # bumped when the device buffer moves (captured CUDA graphs read it in place)
        self._pending = False  # a copy out of the host buffer may still be running
        self.version = 0  # bumped by each ``reserve``: a writer that finds its own version may rewrite in place
        self.reserve(size)

    @property
    def host(self) -> torch.Tensor:
        return self._hosts[self._cur]

    def reserve(self, n: int) -> np.ndarray:
        """The host buffer (at least n elements), once the previous copy out of it has run. A step that
        copies its results back has waited for its stream, upload included (the runner then calls
        ``synced``); one that samples nothing has not, and the next step would rewrite the buffer under
        the copy: only then does this wait for the stream (no event per copy on the usual path). With a ring,
        the next host buffer, once the copy that last read it has run."""
        if self.ring > 1:
            self._cur = (self._cur + 1) % self.ring
            event = self._events[self._cur]
            if event is not None:
                event.synchronize()
        else:
            self._wait()
        self.version += 1
        if n > self.host.numel():
            for e in self._events:  # the buffers are replaced: no copy may still read the old ones
                if e is not None:
                    e.synchronize()
            size = max(n, 2 * self.host.numel(), 1024)
            pin = self.device.type == "cuda"
            self._hosts = [torch.empty(size, dtype=self.dtype, pin_memory=pin) for _ in range(self.ring)]
            self._nps = [h.numpy() for h in self._hosts]
            self.dev = torch.empty(size, dtype=self.dtype, device=self.device)
            self._pairs.clear()
            self.generation += 1
        return self._nps[self._cur]

    def rewrite(self) -> np.ndarray:
        """The host buffer as its last writer left it, to change part of it in place (``version`` unchanged since
        that writer's ``reserve``), once the previous copy out of it has run."""
        self._wait()
        return self._nps[self._cur]

    def _wait(self) -> None:
        if self._pending:
            torch.cuda.current_stream(self.device).synchronize()
            self._pending = False

    def upload(self, n: int) -> None:
        """Copy the first n elements to the device (asynchronously; nothing to do on the CPU). Inside a CUDA
        graph capture the copy becomes a node of the graph, which each replay repeats from the host buffer."""
        if self.device.type != "cpu":
            pair = self._pairs.get((self._cur, n))
            if pair is None:  # slicing costs several µs on a slow host; a graph layout's record size repeats
                pair = (self.dev[:n], self.host[:n])
                if len(self._pairs) < 256:  # packed steps' sizes vary: keep the cache bounded
                    self._pairs[self._cur, n] = pair
            pair[0].copy_(pair[1], non_blocking=True)
            self._pending = True
            if self.ring > 1:
                event = self._events[self._cur] = self._events[self._cur] or torch.cuda.Event()
                event.record()

    def upload_deferred(self) -> None:
        """The host buffer was written for a copy that a graph replay makes (``upload`` captured)."""
        self._pending = self.device.type != "cpu"

    def synced(self) -> None:
        """The device has run past every copy uploaded so far (a blocking copy back on the same stream)."""
        self._pending = False

    def view(self, n: int) -> torch.Tensor:
        """The first n uploaded elements as the step reads them (the host buffer itself on the CPU)."""
        return self.host[:n] if self.device.type == "cpu" else self.dev[:n]
