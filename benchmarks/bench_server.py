"""Load test of ``specserve serve``: requests/s, TTFT and TPOT percentiles at several concurrency levels,
with speculation on and off. Starts the server as a subprocess for each setting, streams chat completions
(greedy, EOS ignored, fixed length) from the chat prompts in ``prompts.py``.

    python benchmarks/bench_server.py --concurrency 1 4 16 --requests 32 --max-tokens 64 [--device cpu]
        [--model PATH --draft HEAD] [--serve-args="--kv-cache-memory 4000000000"] [--client-procs N]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import queue
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import httpx

from specserve.bench.prompts import CHATS


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def start(args, spec: bool):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "specserve.cli", "serve", "--port", str(port), "--device", args.device]
    if args.model:
        cmd += ["--model", args.model]
    if not spec:
        cmd += ["--no-spec"]
    elif args.draft:
        cmd += ["--draft", args.draft]
    cmd += shlex.split(args.serve_args)
    # the caller's path first (packages it installed beside the system's), then this checkout
    path = os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), os.getcwd()) if p)
    log = tempfile.TemporaryFile()  # the server's output, shown if it fails to come up
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONPATH=path))
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + args.start_timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            time.sleep(0.5)
    proc.kill()
    proc.wait()
    log.seek(0)
    tail = log.read().decode(errors="replace")[-3000:]
    raise RuntimeError(f"the server did not come up (exit status {proc.returncode}): {' '.join(cmd)}\n{tail}")


async def one(http, base, prompt, max_tokens):
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first, n = None, 0
    async with http.stream("POST", base + "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                first = first or time.perf_counter()
            if chunk.get("usage"):
                n = chunk["usage"]["completion_tokens"]  # a chunk can carry several accepted tokens
    end = time.perf_counter()
    return first - t0, (end - first) / max(1, n - 1), end - t0


async def _stream_requests(base, conc, indices, max_tokens):
    """``indices`` requests (prompt i % 16), at most ``conc`` at a time -> (ttft, tpot, e2e) per request."""
    sem = asyncio.Semaphore(conc)
    # as many connections as clients (httpx's default pool holds 100: more clients would queue in it)
    limits = httpx.Limits(max_connections=conc, max_keepalive_connections=conc)
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        async def guarded(i):
            async with sem:
                return await one(http, base, CHATS[i % len(CHATS)], max_tokens)

        return await asyncio.gather(*(guarded(i) for i in indices))


def _client(base, conc, indices, max_tokens, ready, go, out):
    """One load-generator process: waits for ``go``, then reports (start, end, results) on ``out``."""
    ready.set()
    go.wait()
    t0 = time.time()
    res = asyncio.run(_stream_requests(base, conc, indices, max_tokens))
    out.put((t0, time.time(), res))


def level(base, conc, requests, max_tokens, procs=1):
    """``requests`` streamed requests at ``conc`` concurrent clients spread over ``procs`` processes (one Python
    process parsing every stream's SSE lines limits the load it can offer: on a 2-core CPU two processes doubled
    the tokens/s a tiny model's server delivered and cut TTFT p50 from ~0.85 s to ~0.14 s)."""
    procs = max(1, min(procs, conc))
    if procs == 1:
        t0 = time.perf_counter()
        res = asyncio.run(_stream_requests(base, conc, range(requests), max_tokens))
        wall = time.perf_counter() - t0
    else:
        ctx = mp.get_context("spawn")
        go, out = ctx.Event(), ctx.Queue()
        workers = []
        for k in range(procs):
            ready = ctx.Event()
            c = conc // procs + (k < conc % procs)
            p = ctx.Process(target=_client, args=(base, c, range(k, requests, procs), max_tokens, ready, go, out))
            p.start()
            workers.append((p, ready))
        for p, ready in workers:
            if not ready.wait(120):
                raise RuntimeError(f"a client process did not start (exit status {p.exitcode})")
        go.set()
        parts = []
        for _ in workers:  # a client process that died would leave its share unreported: fail, don't hang
            while True:
                try:
                    parts.append(out.get(timeout=5))
                    break
                except queue.Empty:
                    dead = [p.exitcode for p, _ in workers if p.exitcode not in (None, 0)]
                    if dead:
                        raise RuntimeError(f"a client process failed (exit status {dead[0]})") from None
        for p, _ in workers:
            p.join()
        wall = max(e for _, e, _ in parts) - min(s for s, _, _ in parts)
        res = [r for _, _, rs in parts for r in rs]
    ttft, tpot, _ = zip(*res)
    return dict(concurrency=conc, requests=requests, client_processes=procs, req_per_s=requests / wall,
                tokens_per_s=requests * max_tokens / wall,
                ttft_ms={q: pct(ttft, q) * 1e3 for q in (50, 90, 99)},
                tpot_ms={q: pct(tpot, q) * 1e3 for q in (50, 90, 99)}, median_ttft_ms=statistics.median(ttft) * 1e3)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--draft", default=None, help="head folder for the speculative server (the default model: its own)")
    p.add_argument("--serve-args", default="", help="more `specserve serve` arguments, one string")
    p.add_argument("--device", default="cpu")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--json", default=None)
    p.add_argument("--start-timeout", type=float, default=240, help="seconds the server may take to come up")
    p.add_argument("--client-procs", type=int, default=max(1, min(8, (os.cpu_count() or 2) // 2)),
                   help="load-generator processes the clients are spread over (default: half the cores, at most 8)")
    a = p.parse_args()
    rows = []
    for spec in (False, True):
        proc, base = start(a, spec)
        try:
            for c in a.concurrency:
                # a warm-up at this level's concurrency first: the engine captures a CUDA graph the first time a
                # step of a new batch size runs, which would otherwise land in the timed requests' latencies
                level(base, c, c, 16, a.client_procs)
                r = dict(spec=spec, **level(base, c, a.requests, a.max_tokens, a.client_procs))
                rows.append(r)
                print(f"spec={spec!s:<5} conc={c:<3} {r['req_per_s']:.2f} req/s {r['tokens_per_s']:.1f} tok/s "
                      f"TTFT p50/p90/p99 {r['ttft_ms'][50]:.0f}/{r['ttft_ms'][90]:.0f}/{r['ttft_ms'][99]:.0f} ms "
                      f"TPOT {r['tpot_ms'][50]:.1f}/{r['tpot_ms'][90]:.1f}/{r['tpot_ms'][99]:.1f} ms", flush=True)
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(date=time.strftime("%Y-%m-%d"), device=a.device, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
