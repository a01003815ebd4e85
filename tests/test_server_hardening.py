"""The server against hostile and careless clients (issue #43), on loopback only: every bad request gets
OpenAI's error body with a 4xx and the next good request succeeds; limits (body size, prompt characters, body
and header read times, request timeout, default max_tokens); the API key, the Host check and /docs; a bounded
load with disconnects; the access and throughput logs; the SIGTERM drain (exit 0, every request ended cleanly)."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

import server_helpers
from server_helpers import free_port, metrics
from tiny_models import PROMPTS, make_head, make_hf_model

KEY = "test-key-123"
AUTH = {"authorization": f"Bearer {KEY}"}


def launch(dirs, log, *extra, model="t", port=None, env=None):
    port = port or free_port()
    cmd = [sys.executable, "-m", "specserve.cli", "serve", "--model", str(dirs / model), "--draft",
           str(dirs / ("h" if model == "t" else "h2")), "--draft-len", "3", "--device", "cpu", "--port", str(port),
           "--served-model-name", "tiny", *extra]
    with open(log, "w") as out:  # the child keeps its own descriptor
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, text=True,
                                env=dict(os.environ, PYTHONUNBUFFERED="1", **(env or {})))
    return proc, f"http://127.0.0.1:{port}"


def wait_up(proc, base, log) -> None:
    server_helpers.wait_up(proc, base, lambda: open(log).read())


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hardening")
    make_hf_model(root / "t", "llama", initializer_range=0.4, num_hidden_layers=8)
    make_head(root / "h", root / "t", "eagle3", draft_vocab=150, seed=1)
    # a longer context, for requests that outlast a timeout or a shutdown grace
    make_hf_model(root / "long", "llama", initializer_range=0.4, num_hidden_layers=8, max_position_embeddings=8192)
    make_head(root / "h2", root / "long", "eagle3", draft_vocab=150, seed=1)
    return root


@pytest.fixture(scope="module")
def srv(dirs):
    """One server for the bad inputs, limits and load; its API key from the environment (as VLLM_API_KEY)."""
    log = dirs / "srv.log"
    proc, base = launch(dirs, log, "--num-kv-blocks", "400", "--max-queue", "300", "--max-request-bytes", "65536",
                        "--max-prompt-chars", "2000", "--body-timeout", "1", "--header-timeout", "1",
                        "--default-max-tokens", "8", "--log-stats-interval", "1", "--timeout-keep-alive", "4",
                        "--allowed-hosts", "Specserve.Test.,other.test",
                        env={"SPECSERVE_API_KEY": KEY})
    try:
        wait_up(proc, base, log)
        yield base, log
        proc.terminate()
        assert proc.wait(timeout=60) == 0
    finally:
        proc.kill()
    text = log.read_text()
    assert "Traceback" not in text and "RuntimeError" not in text and "internal error" not in text, text[-3000:]


@pytest.fixture(scope="module")
def client(srv):
    from openai import OpenAI

    return OpenAI(base_url=srv[0] + "/v1", api_key=KEY, max_retries=0)


def good(client) -> None:
    r = client.completions.create(model="tiny", prompt="hi", max_tokens=3)
    assert r.choices[0].text is not None and r.usage.completion_tokens >= 1


def nested(depth: int) -> str:
    return '{"prompt": "hi", "logit_bias": ' + "[" * depth + "]" * depth + "}"


@pytest.mark.parametrize("path, body, ctype, status, needle", [
    ("/v1/completions", nested(10_000), None, 400, "nests deeper"),
    ("/v1/completions", nested(100), None, 400, "nests deeper"),
    ("/v1/completions", '{"prompt": "hi", "stream": "false"}', None, 400, "'stream' must be a boolean"),
    ("/v1/completions", '{"prompt": "hi", "ignore_eos": "false"}', None, 400, "'ignore_eos' must be a boolean"),
    ("/v1/completions", '{"prompt": [true, 5]}', None, 400, "prompt"),
    ("/v1/completions", '{"prompt": "hi", "stop_token_ids": [true]}', None, 400, "stop_token_ids"),
    ("/v1/completions", '{"prompt": "hi", "max_tokens": true}', None, 400, "max_tokens"),
    ("/v1/completions", '{"prompt": "hi", "temperature": 2.5}', None, 400, "temperature"),
    ("/v1/completions", '{"prompt": "hi", "temperature": Infinity}', None, 400, "Infinity"),
    ("/v1/completions", '{"prompt": "hi", "top_p": NaN}', None, 400, "NaN"),
    ("/v1/completions", '{"prompt": "hi", "temperature": 1e999}', None, 400, "finite"),
    ("/v1/completions", '{"prompt": "hi", "stream": true, "stream_options": {"include_usage": "yes"}}', None, 400,
     "include_usage"),
    ("/v1/completions", '{"prompt": "' + "x" * 2001 + '"}', None, 400, "2000"),
    ("/v1/completions", '{"prompt": "hi"}', "text/plain", 415, "Content-Type"),
    ("/v1/completions", '{"prompt": "hi"}', "", 415, "Content-Type"),
    ("/v1/completions", '{"prompt": "' + "x" * 70_000 + '"}', None, 413, "larger than"),
    ("/v1/chat/completions", '{"messages": [{"role": "wizard", "content": "hi"}]}', None, 400, "unknown role"),
    ("/v1/chat/completions", '{"messages": [{"role": "tool", "content": "hi"}]}', None, 400, "unknown role"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], "functions": [{"name": "f"}]}',
     None, 400, "functions"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}',
     None, 400, "tools"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": 5}]}', None, 400, "content"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "' + "x" * 2001 + '"}]}', None, 400, "2000"),
])
def test_bad_requests_get_4xx_and_the_connection_serves_the_next(srv, client, path, body, ctype, status, needle):
    headers = dict(AUTH)
    if ctype != "":
        headers["content-type"] = ctype or "application/json"
    with httpx.Client(timeout=30) as http:  # one keep-alive connection: the bad request must not break it
        r = http.post(srv[0] + path, content=body, headers=headers)
        assert r.status_code == status, r.text
        err = r.json()["error"]
        assert needle in err["message"] and err["type"] and set(err) == {"message", "type", "param", "code"}
        r = http.post(srv[0] + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers=AUTH)
        assert r.status_code == 200, r.text
    good(client)


def test_api_key_host_check_and_docs(srv, client):
    base = srv[0]
    body = {"prompt": "hi", "max_tokens": 2}
    assert httpx.post(base + "/v1/completions", json=body).status_code == 401
    r = httpx.post(base + "/v1/completions", json=body, headers={"authorization": "Bearer wrong"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(base + "/v1/models").status_code == 401
    assert httpx.get(base + "/health").status_code == 200  # outside /v1: probes need no key
    for path in ("/docs", "/openapi.json", "/redoc"):
        assert httpx.get(base + path).status_code == 404
    # a DNS-rebinding page reaches a loopback server under its own name: refused
    for host in ("evil.example:80", "localhost.evil.example", "127.0.0.1.evil.example", "[::1]x", "specserve.test.x"):
        r = httpx.post(base + "/v1/completions", json=body, headers={**AUTH, "host": host})
        assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden_host", host
        assert r.headers["connection"] == "close"
    port = base.rsplit(":", 1)[1]
    for host in ("localhost", f"localhost:{port}", "localhost.", f"LocalHost.:{port}", f"127.0.0.2:{port}",
                 "127.255.0.1", "[::1]", f"[0:0:0:0:0:0:0:1]:{port}", f"specserve.test:{port}", "other.test."):
        r = httpx.get(base + "/v1/models", headers={**AUTH, "host": host})
        assert r.status_code == 200, (host, r.text)
    # HTTP/1.0 without a Host header
    with socket.create_connection(("127.0.0.1", int(port)), timeout=10) as s:
        s.sendall(b"GET /v1/models HTTP/1.0\r\nAuthorization: Bearer " + KEY.encode() + b"\r\n\r\n")
        assert read_all(s).startswith(b"HTTP/1.1 200")
    # a 401 closes the connection without reading the body the client announced
    r = httpx.post(base + "/v1/completions", json=body, headers={"authorization": "Bearer wrong"})
    assert r.status_code == 401 and r.headers["connection"] == "close"
    with socket.create_connection(("127.0.0.1", int(port)), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 1000000000\r\n\r\n{\"prompt\"")
        t0 = time.time()
        data = read_all(s)
        assert data.startswith(b"HTTP/1.1 401") and b"invalid_api_key" in data and time.time() - t0 < 5, data
    from openai import AuthenticationError, OpenAI

    with pytest.raises(AuthenticationError):
        OpenAI(base_url=base + "/v1", api_key="nope", max_retries=0).models.list()
    good(client)


def read_all(sock) -> bytes:
    """Everything until the server closes the connection (socket.timeout if it does not)."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def test_keep_alive_outlives_the_header_timeout(srv):
    """--timeout-keep-alive (4 s) governs an idle connection between requests, not --header-timeout (1 s),
    which bounds only a request head from its first byte; pipelined requests all get their responses."""
    port = int(srv[0].rsplit(":", 1)[1])
    req = b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n"

    def responses(sock, n) -> bytes:
        data = b""
        while data.count(b"HTTP/1.1 200") < n or not data.endswith(b"}"):
            chunk = sock.recv(65536)
            assert chunk, data
            data += chunk
        return data

    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(req)
        responses(s, 1)
        time.sleep(2.5)  # idle past the header timeout, within the keep-alive
        s.sendall(req * 3)  # pipelined
        assert responses(s, 3).count(b"HTTP/1.1 200") == 3
        t0 = time.time()
        assert read_all(s) == b""  # then closed once idle for the keep-alive period
        assert 3 < time.time() - t0 < 7
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(req)
        responses(s, 1)
        time.sleep(0.5)
        s.sendall(b"GET /health HTTP/1.1\r\n")  # a new request head begun, never finished
        t0 = time.time()
        assert read_all(s) == b"" and time.time() - t0 < 2.5


def test_chat_without_max_tokens_is_bounded_by_the_default(client):
    r = client.chat.completions.create(model="tiny", messages=[{"role": "developer", "content": "be brief"},
                                                               {"role": "user", "content": "Hello"}],
                                       extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 8 and r.choices[0].finish_reason == "length"


def test_slow_clients_are_cut_off(srv, client):
    port = int(srv[0].rsplit(":", 1)[1])

    def closed_within(sock, seconds) -> bool:
        sock.settimeout(seconds)
        try:
            data = b""
            while True:
                chunk = sock.recv(4096)
                if not chunk:
                    return True
                data += chunk
                if b"408" in data:
                    return True
        except socket.timeout:
            return False

    silent = socket.create_connection(("127.0.0.1", port))
    half_head = socket.create_connection(("127.0.0.1", port))
    half_head.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
    half_body = socket.create_connection(("127.0.0.1", port))
    half_body.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer " + KEY.encode()
                      + b"\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"prompt\"")
    t0 = time.time()
    for s in (silent, half_head, half_body):
        assert closed_within(s, 6)
        s.close()
    assert time.time() - t0 < 6
    good(client)


def test_non_streaming_hang_up_aborts_cleanly(srv, client):
    key = ("specserve_requests_total", (("finish_reason", "length"),))
    before = metrics(srv[0]).get(key, 0)
    hung_up = '"POST /v1/completions" 499 client disconnected'
    logged = srv[1].read_text().count(hung_up)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(srv[0] + "/v1/completions", json={"prompt": "hi", "max_tokens": 480, "ignore_eos": True},
                   headers=AUTH, timeout=0.3)
    m = wait_idle(srv[0])
    assert m.get(key, 0) == before  # aborted, not run to its length
    deadline = time.time() + 10
    while srv[1].read_text().count(hung_up) == logged and time.time() < deadline:
        time.sleep(0.1)
    assert srv[1].read_text().count(hung_up) == logged + 1
    good(client)  # the fixture's teardown checks the log holds no RuntimeError (aclose) or traceback


def wait_idle(base) -> dict:
    deadline = time.time() + 30
    while time.time() < deadline:
        m = metrics(base)
        if m[("specserve_num_requests_running", ())] == 0 and m[("specserve_kv_cache_usage_ratio", ())] == 0:
            return m
        time.sleep(0.2)
    raise AssertionError(f"not idle: {m}")


def test_load_256_streams_with_disconnects(srv, client):
    base = srv[0]

    async def one(http, i, cancel):
        chat = i % 2 == 0
        body = {"max_tokens": 6, "temperature": 0.7 if i % 3 else 0, "stream": True, "ignore_eos": True}
        if chat:
            body["messages"] = [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}]
        else:
            body["prompt"] = PROMPTS[i % len(PROMPTS)]
        try:
            async with http.stream("POST", base + ("/v1/chat/completions" if chat else "/v1/completions"), json=body,
                                   headers=AUTH) as r:
                if r.status_code != 200:
                    return r.status_code
                async for line in r.aiter_lines():
                    if cancel and line.startswith("data: "):
                        return "cancelled"
                    if line == "data: [DONE]":
                        return 200
                return "no [DONE]"
        except httpx.HTTPError as e:
            return type(e).__name__

    async def run():
        rng = random.Random(0)
        limits = httpx.Limits(max_connections=300, max_keepalive_connections=300)
        async with httpx.AsyncClient(timeout=90, limits=limits) as http:
            return await asyncio.wait_for(asyncio.gather(*(one(http, i, rng.random() < 0.3) for i in range(256))), 150)

    results = asyncio.run(run())
    assert set(results) <= {200, "cancelled"}, [r for r in results if r not in (200, "cancelled")][:5]
    assert 130 < results.count(200) < 230
    m = wait_idle(base)
    assert m[("specserve_kv_cache_usage_ratio", ())] == 0 and m[("specserve_num_requests_waiting", ())] == 0
    good(client)


def test_access_and_throughput_logs(srv, client):
    good(client)
    time.sleep(1.5)  # a throughput line while busy or after tokens were generated
    text = srv[1].read_text()
    lines = [ln for ln in text.splitlines() if '"POST /v1/completions" 200 prompt=' in ln]
    assert lines and "completion=" in lines[-1] and "ttft=" in lines[-1] and "al=" in lines[-1], text[-2000:]
    assert '"POST /v1/completions" 401 invalid_api_key' in text
    assert "Avg prompt throughput:" in text and "Avg generation throughput:" in text


def test_serving_line_only_once_bound_and_flags_checked_first(dirs, tmp_path, monkeypatch):
    from specserve.cli import build_parser
    from specserve.server.serve import options

    def opts(*args):
        return options(build_parser().parse_args(["serve", *args]))

    monkeypatch.delenv("SPECSERVE_API_KEY", raising=False)
    assert opts().api_key is None and opts().enable_docs is False and opts().default_max_tokens == 4096
    assert opts("--api-key", "k").api_key == "k" and opts("--default-max-tokens", "0").default_max_tokens is None
    assert opts("--host", "0.0.0.0").loopback_hosts_only is False and opts().loopback_hosts_only is True
    assert opts("--allowed-hosts", " A.test., b.test").allowed_hosts == ("a.test", "b.test")
    assert opts("--allowed-hosts", "a.test,*").loopback_hosts_only is False
    with pytest.raises(ValueError, match="--api-key must not be empty"):
        opts("--api-key", "")
    monkeypatch.setenv("SPECSERVE_API_KEY", "from-env")  # an empty flag must not turn the key off
    assert opts().api_key == "from-env" and opts("--api-key", "k").api_key == "k"
    with pytest.raises(ValueError, match="--api-key must not be empty"):
        opts("--api-key", "")
    with pytest.raises(ValueError, match="--max-request-bytes"):
        opts("--max-request-bytes", "0")
    with socket.socket() as busy:  # a port in use: an error, and no "serving" line before it
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        log = tmp_path / "busy.log"
        proc, _ = launch(dirs, log, "--num-kv-blocks", "100", port=busy.getsockname()[1])
        try:
            assert proc.wait(timeout=120) == 1
        finally:
            proc.kill()
    text = log.read_text()
    assert "cannot listen" in text and "serving" not in text, text


def test_timeout_drain_and_docs(dirs, tmp_path):
    """--request-timeout ends a long request with 504; SIGTERM ends the requests still running after the grace
    cleanly (an SSE error event then [DONE]; a 503 error body) and exits 0 (test_server.py's queue test has a
    request finish within the grace)."""
    log = tmp_path / "drain.log"
    proc, base = launch(dirs, log, "--num-kv-blocks", "1200", "--request-timeout", "3", "--shutdown-grace", "1",
                        "--enable-docs", "--disable-log-requests", model="long")
    try:
        wait_up(proc, base, log)
        assert httpx.get(base + "/docs").status_code == 200 and httpx.get(base + "/openapi.json").status_code == 200
        long = {"prompt": "hi", "max_tokens": 8000, "ignore_eos": True}
        t0 = time.time()
        r = httpx.post(base + "/v1/completions", json=long, timeout=30)
        assert r.status_code == 504 and r.json()["error"]["code"] == "request_timeout", r.text
        assert time.time() - t0 < 10
        wait_idle(base)

        got = {}

        def stream():
            with httpx.stream("POST", base + "/v1/chat/completions", timeout=30,
                              json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8000,
                                    "ignore_eos": True, "stream": True}) as s:
                got["stream"] = [ln[6:] for ln in s.iter_lines() if ln.startswith("data: ")]

        def post(name, body):
            got[name] = httpx.post(base + "/v1/completions", json=body, timeout=30)

        threads = [threading.Thread(target=stream), threading.Thread(target=post, args=("long", long))]
        for t in threads:
            t.start()
        deadline = time.time() + 30  # both requests admitted (and running) before the signal
        while metrics(base)[("specserve_num_requests_running", ())] < 2:
            assert time.time() < deadline and all(t.is_alive() for t in threads), got
            time.sleep(0.05)
        t0 = time.time()
        proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(timeout=30)
        assert proc.wait(timeout=30) == 0 and time.time() - t0 < 8
        assert got["long"].status_code == 503 and got["long"].json()["error"]["code"] == "server_shutting_down"
        lines = got["stream"]
        assert lines[-1] == "[DONE]" and json.loads(lines[-2])["error"]["code"] == "server_shutting_down"
        assert len(lines) > 3 and all("choices" in json.loads(ln) for ln in lines[:-2])
        text = log.read_text()
        assert "Traceback" not in text and "shutting down" in text, text[-2000:]
    finally:
        proc.kill()
