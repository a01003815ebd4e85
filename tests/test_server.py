"""The OpenAI-compatible server, started as a subprocess on 127.0.0.1 with a random free port, on a tiny
model with an EAGLE-3 head: the real ``openai`` client, bad requests, and a load with disconnects."""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import sys
import threading
import time

import httpx
import pytest

from specserve import LLM, SamplingParams
from server_helpers import free_port, metrics, wait_up
from tiny_models import PROMPTS, make_head, make_hf_model


def start(dirs, *extra) -> tuple[subprocess.Popen, str]:
    """The server, its output (access logs included) to a file: a pipe nobody reads could fill and stall it."""
    port = free_port()
    cmd = [sys.executable, "-m", "specserve.cli", "serve", "--model", str(dirs / "t"), "--draft", str(dirs / "h"),
           "--draft-len", "3", "--device", "cpu", "--num-kv-blocks", "400", "--port", str(port),
           "--served-model-name", "tiny", *extra]
    log = dirs / f"server-{port}.log"
    with open(log, "w") as out:  # the child keeps its own descriptor
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, text=True,
                                env=dict(os.environ, PYTHONUNBUFFERED="1"))
    base = f"http://127.0.0.1:{port}"
    try:
        wait_up(proc, base, log.read_text)
    except BaseException:
        proc.kill()
        raise
    return proc, base


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("server")
    make_hf_model(root / "t", "llama", initializer_range=0.4, num_hidden_layers=8)
    make_head(root / "h", root / "t", "eagle3", draft_vocab=150, seed=1)
    return root


@pytest.fixture(scope="module")
def server(dirs):
    proc, base = start(dirs, "--max-queue", "200")
    try:
        yield base
        proc.terminate()  # SIGTERM: graceful shutdown, exit 0 once drained
        assert proc.wait(timeout=60) == 0
    finally:
        proc.kill()


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server + "/v1", api_key="unused")


@pytest.fixture(scope="module")
def offline(dirs):
    return LLM(str(dirs / "t"), device="cpu", dtype="float32", num_kv_blocks=400,
               speculative_config=dict(method="eagle3", draft_model=str(dirs / "h"), max_draft_len=3))


def test_models_and_health(client, server):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert httpx.get(server + "/health").json() == {"status": "ok"}


def test_completions_match_offline_greedy(client, offline):
    for p in PROMPTS[:3]:
        r = client.completions.create(model="tiny", prompt=p, max_tokens=12, temperature=0,
                                      extra_body={"ignore_eos": True})
        ref = offline.generate(p, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
        assert r.choices[0].text == ref.text
        assert r.usage.completion_tokens == 12 and r.choices[0].finish_reason == "length"
        assert r.usage.model_extra["spec"]["drafted"] > 0


def test_chat_streaming_and_not(client, offline):
    msgs = [{"role": "user", "content": "Hello world"}]
    full = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=10, temperature=0)
    ids = offline.tokenizer.apply_chat_template(msgs)
    ref = offline.generate([ids], SamplingParams(temperature=0, max_tokens=10))[0]
    assert full.choices[0].message.content == ref.text
    chunks = list(client.chat.completions.create(model="tiny", messages=msgs, max_tokens=10, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ref.text
    assert chunks[-1].usage.completion_tokens == len(ref.token_ids)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == ref.finish_reason


def test_logprobs_in_chat_and_completions(client, offline):
    """Chat's logprobs / top_logprobs and completions' logprobs, whole and streamed: the offline engine's values
    (the target's distribution, speculation on), in OpenAI's shapes."""
    msgs = [{"role": "user", "content": "Hello world"}]
    ids = offline.tokenizer.apply_chat_template(msgs)
    ref = offline.generate([ids], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3))[0]
    want = [(e[t].decoded_token, e[t].logprob) for t, e in zip(ref.token_ids, ref.outputs[0].logprobs)]
    full = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=8, temperature=0, logprobs=True,
                                          top_logprobs=3, extra_body={"ignore_eos": True})
    content = full.choices[0].logprobs.content
    assert [(c.token, round(c.logprob, 4)) for c in content] == [(t, round(v, 4)) for t, v in want]
    assert all(len(c.top_logprobs) == 3 and c.top_logprobs[0].token == c.token for c in content)  # greedy
    assert all(bytes(c.bytes).decode() == c.token for c in content)
    chunks = list(client.chat.completions.create(model="tiny", messages=msgs, max_tokens=8, temperature=0,
                                                 logprobs=True, stream=True, extra_body={"ignore_eos": True}))
    streamed = [c for ch in chunks if ch.choices and ch.choices[0].logprobs for c in ch.choices[0].logprobs.content]
    assert [c.token for c in streamed] == [t for t, _ in want] and all(c.top_logprobs == [] for c in streamed)
    plain = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=4, temperature=0)
    assert plain.choices[0].logprobs is None
    comp = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=6, temperature=0, logprobs=2,
                                     extra_body={"ignore_eos": True})
    lp = comp.choices[0].logprobs
    assert "".join(lp.tokens) == comp.choices[0].text and len(lp.token_logprobs) == 6
    # the top tokens by their text (two byte-level tokens may share one): the greedy token's is the largest
    assert all(1 <= len(t) <= 2 and max(t.values()) == v for t, v in zip(lp.top_logprobs, lp.token_logprobs)), lp
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    with pytest.raises(Exception, match="top_logprobs"):
        client.chat.completions.create(model="tiny", messages=msgs, max_tokens=4, top_logprobs=2)


def test_n_completions_whole_and_streamed(client, offline):
    """n = 3: three choices, choice i the n=1 request with seed + i; streamed, each choice's chunks carry its
    index, its first one the role, its last one its finish reason; usage counts every completion."""
    msgs = [{"role": "user", "content": "Hello world"}]
    ids = offline.tokenizer.apply_chat_template(msgs)
    want = [offline.generate([ids], SamplingParams(temperature=0.9, seed=4 + i, max_tokens=6, ignore_eos=True))[0].text
            for i in range(3)]
    full = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=6, temperature=0.9, seed=4, n=3,
                                          extra_body={"ignore_eos": True})
    assert [c.index for c in full.choices] == [0, 1, 2] and [c.message.content for c in full.choices] == want
    assert full.usage.completion_tokens == 18
    chunks = list(client.chat.completions.create(model="tiny", messages=msgs, max_tokens=6, temperature=0.9, seed=4,
                                                 n=3, stream=True, extra_body={"ignore_eos": True}))
    text = {0: "", 1: "", 2: ""}
    for ch in chunks:
        for c in ch.choices:
            text[c.index] += c.delta.content or ""
    assert [text[i] for i in range(3)] == want
    firsts = {}
    for ch in chunks:
        for c in ch.choices:
            firsts.setdefault(c.index, c.delta.role)
    assert firsts == {0: "assistant", 1: "assistant", 2: "assistant"}
    fins = [c.finish_reason for ch in chunks for c in ch.choices if c.finish_reason]
    assert sorted(fins) == ["length"] * 3
    comp = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=5, temperature=1.0, seed=9, n=2,
                                     extra_body={"ignore_eos": True})
    assert [c.index for c in comp.choices] == [0, 1] and comp.usage.completion_tokens == 10


def test_stop_strings_max_tokens_and_seeds(client):
    base = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=16, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = base[4:7]
    r = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=16, temperature=0, stop=[stop],
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == base[:base.index(stop)] and r.choices[0].finish_reason == "stop"
    a, b, c = (client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=12, temperature=1.0, seed=s,
                                         extra_body={"ignore_eos": True}).choices[0].text for s in (7, 7, 8))
    assert a == b and a != c


@pytest.mark.parametrize("body, status, needle", [
    ("{not json", 400, "not valid JSON"),
    (json.dumps({"model": "gpt-4", "prompt": "hi"}), 404, "does not exist"),
    (json.dumps({"prompt": "hi", "temperature": -1}), 400, "temperature"),
    (json.dumps({"prompt": "hi", "max_tokens": 0}), 400, "max_tokens"),
    (json.dumps({"prompt": "hi", "n": 0}), 400, "n"),
    (json.dumps({"prompt": "hi", "n": 129}), 400, "n"),
    (json.dumps({"prompt": "hi", "top_p": "high"}), 400, "top_p"),
    (json.dumps({"prompt": ""}), 400, "empty"),
    (json.dumps({"prompt": [5] * 1000}), 400, "context"),
    (json.dumps({"prompt": 5}), 400, "prompt"),
    (json.dumps({"prompt": "hi", "presence_penalty": 1.5}), 400, "presence_penalty"),
    (json.dumps({"prompt": "hi", "echo": True}), 400, "echo"),
    (json.dumps({"prompt": "hi", "stream_options": [1]}), 400, "stream_options"),
    (json.dumps({"prompt": "hi", "logprobs": 6}), 400, "logprobs"),
    (json.dumps({"prompt": "hi", "logprobs": True}), 400, "logprobs"),
    (json.dumps({"prompt": "hi", "seed": 2 ** 70, "temperature": 0.5, "top_k": 2 ** 63}), 200, None),
])
def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(server, client, body, status, needle):
    r = httpx.post(server + "/v1/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    if status == 200:  # a seed and a top-k past 64 bits mean what they say (no overflow on the device)
        assert r.json()["choices"][0]["text"] is not None
        return
    err = r.json()["error"]
    assert needle in err["message"] and err["type"]
    assert client.completions.create(model="tiny", prompt="hi", max_tokens=3).choices[0].text is not None


def test_chat_needs_messages(server):
    r = httpx.post(server + "/v1/chat/completions", json={"messages": "hello"})
    assert r.status_code == 400 and "messages" in r.json()["error"]["message"]
    r = httpx.post(server + "/v1/chat/completions", json={"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]})
    assert r.status_code == 400 and "text content parts" in r.json()["error"]["message"]


def test_chat_content_parts_nulls_and_stream_roles(server, offline):
    """Content as OpenAI's text parts equals the joined string; null fields take their defaults; a stream
    names the role in its first chunk only; unknown routes answer in OpenAI's error body."""
    msgs = [{"role": "user", "content": "Hello\nworld"}]
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "world"}]}]
    ref = offline.generate([offline.tokenizer.apply_chat_template(msgs)],
                           SamplingParams(temperature=0, max_tokens=6))[0]
    r = httpx.post(server + "/v1/chat/completions", json={"messages": parts, "max_tokens": 6, "temperature": 0,
                                                          "top_p": None, "seed": None}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == ref.text
    with httpx.stream("POST", server + "/v1/chat/completions", timeout=60,
                      json={"messages": msgs, "max_tokens": 6, "temperature": 0, "stream": True}) as s:
        lines = [ln[6:] for ln in s.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    deltas = [json.loads(ln)["choices"][0]["delta"] for ln in lines[:-1]]
    assert deltas[0]["role"] == "assistant" and all("role" not in d for d in deltas[1:])
    assert "".join(d["content"] for d in deltas) == ref.text
    for method, path, status in (("POST", "/v1/embeddings", 404), ("GET", "/v1/completions", 405)):
        r = httpx.request(method, server + path)
        assert r.status_code == status and r.json()["error"]["message"], r.text


def test_load_with_disconnects_frees_every_block(server, offline):
    async def one(http, i, cancel):
        body = {"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": 16, "temperature": 0, "stream": True,
                "ignore_eos": True}
        text, finish = "", None
        async with http.stream("POST", server + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                ch = json.loads(line[6:])["choices"][0]
                text += ch["text"]
                finish = ch["finish_reason"] or finish
                if cancel and text:
                    return None  # leave mid-stream: the server must abort the request
        return i, text, finish

    async def run():
        rng = random.Random(0)
        async with httpx.AsyncClient(timeout=300) as http:
            return await asyncio.gather(*(one(http, i, rng.random() < 0.3) for i in range(64)))

    results = asyncio.run(run())
    done = [r for r in results if r is not None]
    assert 20 < len(done) < 64
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    refs = {i: offline.generate(PROMPTS[i], sp)[0].text for i in range(len(PROMPTS))}
    for i, text, finish in done:
        assert finish == "length" and text == refs[i % len(PROMPTS)]
    deadline = time.time() + 30
    while time.time() < deadline:
        m = metrics(server)
        if m[("specserve_num_requests_running", ())] == 0 and m[("specserve_kv_cache_usage_ratio", ())] == 0:
            break
        time.sleep(0.2)
    assert m[("specserve_kv_cache_usage_ratio", ())] == 0
    assert m[("specserve_num_requests_waiting", ())] == 0
    assert m[("specserve_requests_total", (("finish_reason", "length"),))] >= len(done)
    assert m[("specserve_spec_draft_tokens", ())] > 0
    # a fixed draft length of 3: every speculative step proposed 3 drafts a row
    assert m[("specserve_spec_draft_len", ())] == 3
    assert m[("specserve_spec_steps_by_draft_len", (("draft_len", "3"),))] > 0
    assert m.get(("specserve_spec_steps_by_draft_len", (("draft_len", "0"),)), 0) == 0


def test_non_streaming_client_that_hangs_up_is_cancelled(server):
    key = ("specserve_requests_total", (("finish_reason", "length"),))
    before = metrics(server).get(key, 0)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server + "/v1/completions", json={"prompt": "hi", "max_tokens": 480, "ignore_eos": True},
                   timeout=0.5)
    deadline = time.time() + 30
    while time.time() < deadline:
        m = metrics(server)
        if m[("specserve_num_requests_running", ())] == 0:
            break
        time.sleep(0.2)
    time.sleep(0.5)
    m = metrics(server)
    assert m[("specserve_num_requests_running", ())] == 0 and m[("specserve_kv_cache_usage_ratio", ())] == 0
    assert m.get(key, 0) == before  # aborted, not run to its length


def test_queue_limit_answers_429(dirs):
    proc, base = start(dirs, "--max-queue", "2")
    try:
        async def run():
            async with httpx.AsyncClient(timeout=120) as http:
                body = {"prompt": "hello", "max_tokens": 64, "ignore_eos": True}
                return await asyncio.gather(*(http.post(base + "/v1/completions", json=body) for _ in range(12)))

        codes = [r.status_code for r in asyncio.run(run())]
        assert 429 in codes and 200 in codes and set(codes) <= {200, 429}
        assert httpx.post(base + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200
        # SIGTERM while a request is in flight: it still completes, then the server exits
        got = {}
        t = threading.Thread(target=lambda: got.update(r=httpx.post(
            base + "/v1/completions", json={"prompt": "hi", "max_tokens": 200, "ignore_eos": True}, timeout=60)))
        t.start()
        deadline = time.time() + 30  # admitted before the signal
        while metrics(base)[("specserve_num_requests_running", ())] < 1:
            assert time.time() < deadline and t.is_alive(), got
            time.sleep(0.05)
        proc.terminate()
        t.join(timeout=60)
        assert got["r"].status_code == 200 and got["r"].json()["usage"]["completion_tokens"] == 200
        assert proc.wait(timeout=60) == 0
    finally:
        proc.kill()


def test_serve_takes_the_model_as_vllm_serve_does(monkeypatch, capsys):
    import specserve
    from specserve.cli import main

    seen = []

    def engine(args):
        seen.append(args.model)
        raise ValueError("stop here")  # no server started: the test checks how the model reached the engine

    monkeypatch.setattr(specserve, "LLMEngine", engine)
    assert main(["serve", "/models/m"]) == 2 and seen == ["/models/m"]
    assert main(["serve", "--model", "/models/m"]) == 2 and seen[-1] == "/models/m"
    assert main(["serve", "/models/m", "--model", "/models/m"]) == 2 and len(seen) == 3
    assert main(["serve", "/models/a", "--model", "/models/b"]) == 2 and len(seen) == 3
    assert "two models given" in capsys.readouterr().err
