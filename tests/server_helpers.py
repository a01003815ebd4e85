"""Starting the server under test: a free loopback port, and waiting until /health answers."""

from __future__ import annotations

import socket
import time
from typing import Callable

import httpx
from prometheus_client.parser import text_string_to_metric_families


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_up(proc, base: str, output: Callable[[], str], timeout: float = 120) -> None:
    """Wait for ``base``/health; ``output`` gives what the server printed, for the error if it exits first."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {output()}")
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("server did not start")


def metrics(base: str) -> dict:
    """The server's Prometheus samples: (name, sorted labels) -> value."""
    out = {}
    for fam in text_string_to_metric_families(httpx.get(base + "/metrics").text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out
