"""Staging buffers: a pinned host buffer and its device twin, the one way a step's host-built inputs reach the
device (one copy per buffer and step; captured CUDA graphs read the device twin in place)."""

from __future__ import annotations

import numpy as np
import torch


class Staging:
    """A pinned host buffer and its device twin; ``upload(n)`` copies the first n elements."""

    def __init__(self, dtype: torch.dtype, device: torch.device, size: int = 0) -> None:
        self.dtype, self.device = dtype, device
        self.host = torch.empty(0, dtype=dtype)
        self.dev = torch.empty(0, dtype=dtype, device=device)
        self._np = self.host.numpy()
        self._pairs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # n -> (device, host) slices
        self.generation = 0  # bumped when the device buffer moves (captured CUDA graphs read it in place)
        self._pending = False  # a copy out of the host buffer may still be running
        self.version = 0  # bumped by each ``reserve``: a writer that finds its own version may rewrite in place
        self.reserve(size)

    def reserve(self, n: int) -> np.ndarray:
        """The host buffer (at least n elements), once the previous copy out of it has run. A step that
        copies its results back has waited for its stream, upload included (the runner then calls
        ``synced``); one that samples nothing has not, and the next step would rewrite the buffer under
        the copy: only then does this wait for the stream (no event per copy on the usual path)."""
        self._wait()
        self.version += 1
        if n > self.host.numel():
            size = max(n, 2 * self.host.numel(), 1024)
            pin = self.device.type == "cuda"
            self.host = torch.empty(size, dtype=self.dtype, pin_memory=pin)
            self.dev = torch.empty(size, dtype=self.dtype, device=self.device)
            self._np = self.host.numpy()
            self._pairs.clear()
            self.generation += 1
        return self._np

    def rewrite(self) -> np.ndarray:
        """The host buffer as its last writer left it, to change part of it in place (``version`` unchanged since
        that writer's ``reserve``), once the previous copy out of it has run."""
        self._wait()
        return self._np

    def _wait(self) -> None:
        if self._pending:
            torch.cuda.current_stream(self.device).synchronize()
            self._pending = False

    def upload(self, n: int) -> None:
        """Copy the first n elements to the device (asynchronously; nothing to do on the CPU). Inside a CUDA
        graph capture the copy becomes a node of the graph, which each replay repeats from the host buffer."""
        if self.device.type != "cpu":
            pair = self._pairs.get(n)
            if pair is None:  # slicing costs several µs on a slow host; a graph layout's record size repeats
                pair = (self.dev[:n], self.host[:n])
                if len(self._pairs) < 256:  # packed steps' sizes vary: keep the cache bounded
                    self._pairs[n] = pair
            pair[0].copy_(pair[1], non_blocking=True)
            self._pending = True

    def upload_deferred(self) -> None:
        """The host buffer was written for a copy that a graph replay makes (``upload`` captured)."""
        self._pending = self.device.type != "cpu"

    def synced(self) -> None:
        """The device has run past every copy uploaded so far (a blocking copy back on the same stream)."""
        self._pending = False

    def view(self, n: int) -> torch.Tensor:
        """The first n uploaded elements as the step reads them (the host buffer itself on the CPU)."""
        return self.host[:n] if self.device.type == "cpu" else self.dev[:n]
