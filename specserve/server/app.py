"""OpenAI-compatible HTTP API on FastAPI: completions and chat completions (streaming or not), models,
health and Prometheus metrics. Errors use OpenAI's body: ``{"error": {"message", "type", "param", "code"}}``,
with a 4xx for anything the client got wrong (never a 500 or a dropped connection).

What a request passes before it reaches the engine, in order: the Host check (a server bound to loopback
answers only loopback names: a DNS-rebinding page cannot reach it), the API key on ``/v1/*``, the JSON
Content-Type (a cross-origin page can POST ``text/plain`` without a preflight, not JSON), the body size and
read time, the JSON parse (nesting depth bounded, no ``NaN``/``Infinity``), strict field types, the prompt's
length in characters, then tokenization and chat templating on a thread pool (neither the event loop nor the
engine thread waits on a large prompt)."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import hmac
import ipaddress
import json
import logging
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from specserve.sampling_params import RequestOutputKind
from specserve.server.async_engine import AsyncEngine, EngineFailed, QueueFull, ShuttingDown, usage_of
from specserve.server.metrics import ServerMetrics
from specserve.server.protocol import (APIError, ServerOptions, body_field, chat_logprobs, check_messages,
                                       completion_logprobs, parse_json, sampling_params)
from specserve.tokenizer import Tokenizer

log = logging.getLogger("specserve")
access_log = logging.getLogger("specserve.access")


class _Tokenizers:
    """Tokenization and chat templating on a thread pool, each worker with its own copy of the tokenizer
    (a fast tokenizer is not safe to call from several threads at once)."""

    def __init__(self, tokenizer: Tokenizer, workers: int) -> None:
        self.base = tokenizer
        self.local = threading.local()
        self.pool = ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="specserve-tok")

    def _tok(self) -> Tokenizer:
        tok = getattr(self.local, "tok", None)
        if tok is None:
            tok = self.local.tok = Tokenizer(copy.deepcopy(self.base.hf))
        return tok

    async def run(self, fn_name: str, arg):
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.pool, lambda: getattr(self._tok(), fn_name)(arg))


class _Guard:
    """Pure ASGI middleware: Host check, API key on /v1/*, and the response status for the access log."""

    def __init__(self, app, opts: ServerOptions) -> None:
        self.app, self.opts = app, opts
        self.key = opts.api_key.encode() if opts.api_key else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        err = None
        if self.opts.loopback_hosts_only and not host_allowed(headers.get(b"host", b""), self.opts.allowed_hosts):
            err = APIError(403, "this server is bound to a loopback address and answers only loopback host names "
                                "(and those of --allowed-hosts)", code="forbidden_host", close=True)
        if err is None and self.key is not None and scope["path"].startswith("/v1/"):
            auth = headers.get(b"authorization", b"")
            scheme, _, token = auth.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.key):
                # the body is not read (an unauthenticated client may send any size): close after the reply
                err = APIError(401, "invalid or missing API key (send 'Authorization: Bearer KEY')",
                               code="invalid_api_key", close=True)
        if err is not None:
            _log_access(self.opts, scope, err.status, err.code)
            return await err.response()(scope, receive, send)
        return await self.app(scope, receive, send)


def host_allowed(host: bytes, allowed=()) -> bool:
    """Whether a Host header names this loopback server: absent (HTTP/1.0), a name that parses as a loopback
    address (any of 127/8, ``::1`` in any spelling), ``localhost``, or one of ``allowed``; a port and a
    trailing dot are ignored."""
    h = host.decode("latin-1").strip().lower()
    if not h:
        return True
    if h.startswith("["):
        end = h.find("]")
        if end < 0 or (h[end + 1:] and not h[end + 1:].startswith(":")):
            return False
        name = h[1:end]
    else:
        name = h.rsplit(":", 1)[0] if h.count(":") == 1 else h
    name = name[:-1] if name.endswith(".") else name
    if name == "localhost" or name in allowed:
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def _log_access(opts: ServerOptions, scope, status: int, detail: str | None = None, out=None) -> None:
    if not opts.log_requests:
        return
    client = (scope.get("client") or ("-",))[0]
    line = f'{client} "{scope.get("method")} {scope.get("path")}" {status}'
    if out is not None:
        t = out.timings()
        line += f" prompt={len(out.prompt_token_ids)} completion={len(out.token_ids)} finish={out.finish_reason}"
        if t.get("ttft_s") is not None:
            line += f" ttft={t['ttft_s']:.3f}s"
        if t.get("e2e_s") is not None:
            line += f" e2e={t['e2e_s']:.3f}s"
        if out.spec is not None and out.spec.acceptance_length:
            line += f" al={out.spec.acceptance_length:.2f}"
    if detail:
        line += f" {detail}"
    access_log.info(line)


def build_app(engine: AsyncEngine, model_name: str, opts: ServerOptions | None = None) -> FastAPI:
    opts = opts or ServerOptions()
    docs = opts.enable_docs
    app = FastAPI(title="specserve", docs_url="/docs" if docs else None, redoc_url="/redoc" if docs else None,
                  openapi_url="/openapi.json" if docs else None)
    metrics = ServerMetrics(engine.engine)
    tokenizers = _Tokenizers(engine.engine.tokenizer, opts.tokenizer_workers)
    max_len = engine.engine.max_model_len
    max_chars = opts.max_prompt_chars if opts.max_prompt_chars is not None else max(65536, 32 * max_len)
    app.state.tokenizers = tokenizers
    app.add_middleware(_Guard, opts=opts)

    def _error(req: Request, e: APIError) -> Response:
        metrics.rejected.labels(e.code or str(e.status)).inc()
        _log_access(opts, req.scope, e.status, e.code)
        return e.response()

    @app.exception_handler(APIError)
    async def _api_error(req, e: APIError):
        return _error(req, e)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(req, e: StarletteHTTPException):  # unknown routes and methods, in OpenAI's body
        return _error(req, APIError(e.status_code, str(e.detail), code=str(e.status_code)))

    @app.exception_handler(Exception)
    async def _internal_error(req, e: Exception):  # Starlette logs the traceback
        return _error(req, APIError(500, f"internal error: {type(e).__name__}: {e}", code="internal_error",
                                    kind="server_error"))

    async def _read(request: Request) -> bytes:
        size = request.headers.get("content-length")
        if size is not None and (not size.isdigit() or int(size) > opts.max_request_bytes):
            raise APIError(413, f"request body is larger than {opts.max_request_bytes} bytes",
                           code="request_too_large", close=True)
        chunks, total = [], 0
        async for chunk in request.stream():
            total += len(chunk)
            if total > opts.max_request_bytes:
                raise APIError(413, f"request body is larger than {opts.max_request_bytes} bytes",
                               code="request_too_large", close=True)
            chunks.append(chunk)
        return b"".join(chunks)

    async def _body(request: Request) -> dict:
        if engine.closing:
            raise APIError(503, "the server is shutting down", code="server_shutting_down", kind="server_error")
        ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if ctype != "application/json":
            raise APIError(415, f"Content-Type must be application/json, got {ctype or 'none'!r}",
                           code="unsupported_media_type", close=True)
        try:
            raw = await asyncio.wait_for(_read(request), opts.body_timeout)
        except TimeoutError:
            raise APIError(408, f"request body not received within {opts.body_timeout:g} s",
                           code="request_timeout", close=True) from None
        body = parse_json(raw)
        model = body.get("model")
        if model is not None and model != model_name:
            raise APIError(404, f"the model '{str(model)[:100]}' does not exist; this server serves '{model_name}'",
                           param="model", code="model_not_found")
        return body

    def _too_long(chars: int) -> APIError:
        return APIError(400, f"prompt has {chars} characters; this server takes at most {max_chars} "
                             f"(the context is {max_len} tokens)", param="prompt", code="context_length_exceeded")

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0,
                                            "owned_by": "specserve"}]}

    @app.get("/metrics")
    async def prom():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await _body(request)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            if any(t < 0 for t in prompt):
                raise APIError(400, "prompt token ids must be non-negative", param="prompt")
            if len(prompt) >= max_len:
                raise APIError(400, f"prompt has {len(prompt)} tokens but the context is {max_len} "
                                    "(max_model_len)", param="prompt", code="context_length_exceeded")
            ids = prompt
        elif isinstance(prompt, str):
            if not prompt:
                raise APIError(400, "prompt is empty", param="prompt")
            if len(prompt) > max_chars:
                raise _too_long(len(prompt))
            params = sampling_params(body, False, opts)  # bad fields answered before the tokenizer's work
            return await _serve(request, body, await tokenizers.run("encode", prompt), chat=False, params=params)
        else:
            raise APIError(400, "'prompt' must be a string or a list of token ids (one prompt)", param="prompt")
        return await _serve(request, body, ids, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await _body(request)
        msgs = body.get("messages")
        chars = check_messages(msgs)
        if chars > max_chars:
            raise _too_long(chars)
        params = sampling_params(body, True, opts)
        msgs = [dict(m, role="system") if m["role"] == "developer" else m for m in msgs]
        try:  # text content parts joined there (tokenizer.chat_message)
            prompt = await tokenizers.run("apply_chat_template", msgs)
        except Exception as e:
            raise APIError(400, f"cannot apply the chat template: {str(e)[:300]}", param="messages") from None
        return await _serve(request, body, prompt, chat=True, params=params)

    async def _serve(request: Request, body: dict, prompt: list[int], chat: bool, params=None):
        params = params or sampling_params(body, chat, opts)
        stream = body_field(body, "stream", bool, False)
        if not stream:  # the reply goes out whole: the engine need not report the request before it ends
            params = dataclasses.replace(params, output_kind=RequestOutputKind.FINAL_ONLY)
        options = body_field(body, "stream_options", dict, {})
        include_usage = body_field(options, "include_usage", bool, False)
        cid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        obj = "chat.completion" if chat else "text_completion"
        loop = asyncio.get_running_loop()
        deadline = None if not opts.request_timeout else loop.time() + opts.request_timeout
        gen = engine.generate(prompt, params)

        def failure(e: BaseException) -> APIError:
            if isinstance(e, QueueFull):
                return APIError(429, str(e), code="queue_full", kind="rate_limit_error")
            if isinstance(e, ValueError):
                return APIError(400, str(e), param="prompt" if "prompt" in str(e) else None)
            if isinstance(e, ShuttingDown):
                return APIError(503, str(e), code="server_shutting_down", kind="server_error")
            if isinstance(e, TimeoutError):
                return APIError(504, f"the request ran past the server's limit of {opts.request_timeout:g} s",
                                code="request_timeout", kind="server_error")
            if isinstance(e, EngineFailed):
                return APIError(500, str(e), code="engine_error", kind="server_error")
            return APIError(500, f"internal error: {type(e).__name__}: {e}", code="internal_error",
                            kind="server_error")

        async def next_out():
            if deadline is None:
                return await gen.__anext__()
            # in this task (no task a chunk, as wait_for makes): a timeout cancels the wait, which aborts the request
            async with asyncio.timeout_at(deadline):
                return await gen.__anext__()

        def choice(out, delta: bool, index: int, first_chunk: bool = False):
            """Completion ``index`` of ``out``: whole, or (``delta``) what this output adds to it."""
            comp = out.outputs[index]
            text = out.delta_text if delta else comp.text
            fin = comp.finish_reason
            lps = None
            if params.logprobs is not None:  # the tokens this choice reports: the chunk's, or all of them
                count = len(out.delta_token_ids) if delta else len(comp.token_ids)
                lps = (chat_logprobs(comp, count, params.logprobs) if chat else
                       completion_logprobs(comp, count, params.logprobs, len(comp.text) - len(text) if delta else 0))
            if chat:
                if not delta:
                    return {"index": index, "message": {"role": "assistant", "content": text}, "finish_reason": fin,
                            "logprobs": lps}
                msg = {"role": "assistant", "content": text} if first_chunk else {"content": text}
                return {"index": index, "delta": msg, "finish_reason": fin, "logprobs": lps}
            return {"index": index, "text": text, "finish_reason": fin, "logprobs": lps}

        if not stream:
            async def collect():
                out = await next_out()
                while not out.finished:
                    out = await next_out()
                return out

            task = asyncio.ensure_future(collect())
            try:
                while not task.done():  # a client that hangs up aborts its request (and frees its blocks)
                    await asyncio.wait({task}, timeout=0.25)
                    if not task.done() and await request.is_disconnected():
                        task.cancel()
                        await asyncio.gather(task, return_exceptions=True)  # the generator has closed itself
                        _log_access(opts, request.scope, 499, "client disconnected")
                        return Response(status_code=499)
            finally:
                if not task.done():  # this handler was cancelled (shutdown past uvicorn's own timeout)
                    task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                await gen.aclose()
            if task.exception() is not None:
                raise failure(task.exception())
            out = task.result()
            metrics.observe_finished(out)
            _log_access(opts, request.scope, 200, out=out)
            return {"id": cid, "object": obj, "created": created, "model": model_name,
                    "choices": [choice(out, False, i) for i in range(len(out.outputs))], "usage": usage_of(out)}

        try:  # the first output before the status line: a refused request gets its 4xx
            first = await next_out()
        except Exception as e:
            await gen.aclose()
            raise failure(e) from None

        async def sse():
            out = first
            chunk_obj = "chat.completion.chunk" if chat else "text_completion"
            status, detail = 200, None
            try:
                started: set[int] = set()  # completions whose first chunk (with the role) has gone
                while True:
                    i = out.delta_index
                    payload = {"id": cid, "object": chunk_obj, "created": created, "model": model_name,
                               "choices": [choice(out, True, i, i not in started)]}
                    started.add(i)
                    if include_usage:
                        payload["usage"] = None
                    yield f"data: {json.dumps(payload)}\n\n"
                    if out.finished:
                        break
                    out = await next_out()
                metrics.observe_finished(out)
                if include_usage:
                    yield f"data: {json.dumps({'id': cid, 'object': chunk_obj, 'created': created, 'model': model_name, 'choices': [], 'usage': usage_of(out)})}\n\n"
                yield "data: [DONE]\n\n"
            except asyncio.CancelledError:  # the client went away (or uvicorn gave up on the drain)
                status, detail = 499, "client disconnected"
                raise
            except Exception as e:  # the status line is sent already: the error goes in the stream, then its end
                err = failure(e)
                if err.status >= 500 and not isinstance(e, (ShuttingDown, TimeoutError)):
                    log.error("stream failed: %s", err.message)
                status, detail = err.status, err.code
                yield f"data: {json.dumps(err.body())}\n\n"
                yield "data: [DONE]\n\n"
            finally:
                await gen.aclose()  # a client that went away aborts its request and frees its blocks
                _log_access(opts, request.scope, status, detail, out=out if status == 200 else None)

        return StreamingResponse(sse(), media_type="text/event-stream")

    return app
