"""``specserve serve``: the server's flags, uvicorn's configuration, the access and throughput logs, and the
SIGTERM drain. ``cli.py`` adds these flags to its ``serve`` parser and calls ``run`` with the engine."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import logging
import os
import socket
import sys
import time

from specserve.server.async_engine import AsyncEngine, ShuttingDown
from specserve.server.protocol import ServerOptions

API_KEY_ENV = "SPECSERVE_API_KEY"
stats_log = logging.getLogger("specserve.stats")


def add_server_args(sv: argparse.ArgumentParser) -> None:
    d = ServerOptions()
    sv.add_argument("--host", default="127.0.0.1",
                    help="address to bind (default: %(default)s; loopback answers only loopback Host names)")
    sv.add_argument("--port", type=int, default=8000, help="default: %(default)s")
    sv.add_argument("--served-model-name", default=None, help="model id in the API (default: the model's name)")
    sv.add_argument("--max-queue", type=int, default=256,
                    help="requests in flight before answering 429 (default: %(default)s)")
    g = sv.add_argument_group("server limits and security")
    g.add_argument("--api-key", default=None,
                   help=f"require 'Authorization: Bearer KEY' on /v1/* (default: ${API_KEY_ENV}, else none)")
    g.add_argument("--allowed-hosts", default="",
                   help="comma-separated Host names a loopback-bound server also answers, besides localhost and "
                        "loopback addresses (e.g. a name mapped to 127.0.0.1); '*': any Host (default: none)")
    g.add_argument("--enable-docs", action="store_true", help="serve /docs, /redoc and /openapi.json (off by default)")
    g.add_argument("--max-request-bytes", type=int, default=d.max_request_bytes,
                   help="largest request body, else 413 (default: %(default)s)")
    g.add_argument("--max-prompt-chars", type=int, default=None,
                   help="longest prompt in characters, checked before tokenizing (default: 32 per token of the "
                        "context, at least 65536)")
    g.add_argument("--default-max-tokens", type=int, default=d.default_max_tokens,
                   help="max_tokens of a chat completion that sets none (default: %(default)s; 0: up to the "
                        "context, as vLLM); completions default to 16 as OpenAI's")
    g.add_argument("--max-tokens-limit", type=int, default=None,
                   help="largest max_tokens a request may ask for, else 400 (default: the context)")
    g.add_argument("--request-timeout", type=float, default=d.request_timeout,
                   help="seconds a request may run before it is ended with 504 or an SSE error (default: "
                        "%(default)s; 0: none)")
    g.add_argument("--body-timeout", type=float, default=d.body_timeout,
                   help="seconds to receive a request body, else 408 (default: %(default)s)")
    g.add_argument("--header-timeout", type=float, default=10.0,
                   help="seconds a connection may take to send a request's headers (default: %(default)s)")
    g.add_argument("--timeout-keep-alive", type=float, default=5.0,
                   help="seconds an idle keep-alive connection stays open (default: %(default)s)")
    g.add_argument("--limit-concurrency", type=int, default=1024,
                   help="open connections (and requests) past which uvicorn answers 503 (default: %(default)s)")
    g.add_argument("--shutdown-grace", type=float, default=30.0,
                   help="on SIGTERM/SIGINT, seconds in-flight requests may finish; then each remaining one is "
                        "ended with an error and the server exits 0 (default: %(default)s)")
    g.add_argument("--disable-log-requests", action="store_true",
                   help="no access-log line per request and no periodic throughput line")
    g.add_argument("--log-stats-interval", type=float, default=10.0,
                   help="seconds between throughput lines while busy (default: %(default)s)")


def options(a: argparse.Namespace) -> ServerOptions:
    """The parsed flags -> ServerOptions (ValueError on bad values)."""
    for name in ("max_request_bytes", "body_timeout", "header_timeout", "timeout_keep_alive", "limit_concurrency"):
        if getattr(a, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive")
    for name in ("request_timeout", "shutdown_grace", "default_max_tokens"):
        if getattr(a, name) < 0:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 0")
    if a.max_prompt_chars is not None and a.max_prompt_chars <= 0:
        raise ValueError("--max-prompt-chars must be positive")
    if a.max_tokens_limit is not None and a.max_tokens_limit <= 0:
        raise ValueError("--max-tokens-limit must be positive")
    if a.api_key is not None and not a.api_key.strip():
        raise ValueError(f"--api-key must not be empty (leave it out for no key, or set ${API_KEY_ENV})")
    key = a.api_key if a.api_key is not None else os.environ.get(API_KEY_ENV) or None
    hosts = [h.strip().lower().rstrip(".") for h in a.allowed_hosts.split(",") if h.strip()]
    default_max = a.default_max_tokens or None
    if default_max is not None and a.max_tokens_limit is not None:
        default_max = min(default_max, a.max_tokens_limit)
    return ServerOptions(api_key=key, enable_docs=a.enable_docs, max_request_bytes=a.max_request_bytes,
                         max_prompt_chars=a.max_prompt_chars, body_timeout=a.body_timeout,
                         request_timeout=a.request_timeout or None, default_max_tokens=default_max,
                         max_max_tokens=a.max_tokens_limit,
                         loopback_hosts_only=_is_loopback(a.host) and "*" not in hosts, allowed_hosts=tuple(hosts),
                         log_requests=not a.disable_log_requests)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _protocol(header_timeout: float):
    """uvicorn's h11 protocol with a header timeout: a connection is closed when a request head is not complete
    within ``header_timeout`` of the connection's opening or of the request's first byte (slow-header clients).
    A connection idle between requests is left to uvicorn's ``--timeout-keep-alive``, and one with a request or
    response in progress is never closed by this timer."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class Protocol(H11Protocol):
        _head_timer = None

        def _waiting_for_head(self) -> bool:  # between requests: no request head complete, no response going
            return self.conn.their_state is h11.IDLE and self.conn.our_state is h11.IDLE

        def _arm(self) -> None:
            self._disarm()
            self._head_timer = self.loop.call_later(header_timeout, self._head_timeout)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_timeout(self) -> None:
            self._head_timer = None
            if self._waiting_for_head() and not self.transport.is_closing():
                self.transport.close()

        def _track(self) -> None:
            if self.transport.is_closing():
                self._disarm()
            elif not self._waiting_for_head():
                self._disarm()  # the head is complete (or the connection errored): the timer is done
            elif self._head_timer is None and self.conn.trailing_data[0]:
                self._arm()  # the first bytes of a new request head

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            self._track()

        def on_response_complete(self) -> None:
            super().on_response_complete()  # arms uvicorn's keep-alive timer, then handles pipelined bytes
            self._track()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

    return Protocol


async def _log_stats(engine: AsyncEngine, interval: float) -> None:
    """vLLM's periodic line: prompt and generation throughput, requests, KV usage, acceptance length."""
    eng = engine.engine
    last_t, last_p, last_g = time.monotonic(), engine.prompt_tokens_total, engine.generated_tokens_total
    while True:
        await asyncio.sleep(interval)
        now, p, g = time.monotonic(), engine.prompt_tokens_total, engine.generated_tokens_total
        running, waiting = len(eng.scheduler.running), len(eng.scheduler.waiting)
        if p != last_p or g != last_g or running or waiting:
            dt = now - last_t
            line = (f"Avg prompt throughput: {(p - last_p) / dt:.1f} tokens/s, Avg generation throughput: "
                    f"{(g - last_g) / dt:.1f} tokens/s, Running: {running} reqs, Waiting: {waiting} reqs, "
                    f"KV cache usage: {100 * eng.pool.usage():.1f}%")
            al = eng.spec_stats.acceptance_length
            if al:
                line += f", Acceptance length: {al:.2f}"
            stats_log.info(line)
        last_t, last_p, last_g = now, p, g


def run(a: argparse.Namespace, load) -> int:
    """Checks the server's flags, then ``load()`` -> (LLMEngine, served model name), and serves it until
    SIGTERM/SIGINT; returns the exit status (0 after a drain, 2 for bad flags or a model that cannot load)."""
    import uvicorn

    try:
        opts = options(a)
        engine, name = load()
    except (ValueError, FileNotFoundError) as e:
        print(f"specserve: error: {e}", file=sys.stderr)
        return 2
    if opts.log_requests:
        for lg in ("specserve.access", "specserve.stats"):
            logging.getLogger(lg).setLevel(logging.INFO)
    from specserve.server.app import build_app  # FastAPI: only to serve (the other commands run without it)

    async_engine = AsyncEngine(engine, max_queue=a.max_queue)
    app = build_app(async_engine, name, opts)

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        task = asyncio.ensure_future(_log_stats(async_engine, a.log_stats_interval)) if opts.log_requests else None
        yield
        if task is not None:
            task.cancel()
        async_engine.shutdown()  # after every connection has ended (the drain below)
        app.state.tokenizers.pool.shutdown(wait=False, cancel_futures=True)

    app.router.lifespan_context = lifespan
    grace = a.shutdown_grace

    class Server(uvicorn.Server):
        draining = False

        async def serve(self, sockets=None):
            self._loop = asyncio.get_running_loop()
            await super().serve(sockets)

        def handle_exit(self, sig, frame) -> None:
            # not recorded in _captured_signals: uvicorn would re-raise it at the end (exit 143)
            if self.should_exit:
                self.force_exit = True  # a second signal: stop waiting
                return
            self.should_exit = True
            if not self.draining:
                self.draining = True
                self._loop.call_soon_threadsafe(self._drain)

        def _drain(self) -> None:
            async_engine.closing = True
            print(f"specserve: shutting down: in-flight requests have {grace:g} s to finish", file=sys.stderr,
                  flush=True)
            self._loop.call_later(grace, async_engine.abort_all, ShuttingDown(
                f"the server shut down before this request finished (grace {grace:g} s)"))

    try:  # bound before "serving" is printed: a port in use is an error, not a false start
        family = socket.AF_INET6 if ":" in a.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((a.host, a.port))
        sock.listen(2048)
        sock.set_inheritable(True)
    except OSError as e:
        async_engine.shutdown()
        print(f"specserve: error: cannot listen on {a.host}:{a.port}: {e.strerror or e}", file=sys.stderr)
        return 1
    config = uvicorn.Config(app, log_level="warning", http=_protocol(a.header_timeout),
                            timeout_keep_alive=a.timeout_keep_alive, limit_concurrency=a.limit_concurrency,
                            timeout_graceful_shutdown=grace + 10)  # a backstop: the drain ends requests first
    port = sock.getsockname()[1]
    host = f"[{a.host}]" if ":" in a.host else a.host
    print(f"specserve: serving {name} on http://{host}:{port}/v1", file=sys.stderr, flush=True)
    Server(config).run(sockets=[sock])
    return 0
