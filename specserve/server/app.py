"""OpenAI-compatible HTTP API on FastAPI: completions and chat completions (streaming or not), models,
health and Prometheus metrics. Errors use OpenAI's body: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from specserve.sampling_params import SamplingParams
from specserve.server.async_engine import AsyncEngine, QueueFull, usage_of
from specserve.server.metrics import ServerMetrics


log = logging.getLogger("specserve")


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def response(self) -> JSONResponse:
        return JSONResponse({"error": {"message": self.message, "type": self.kind, "param": self.param,
                                       "code": self.code}}, status_code=self.status)


_NUM = (int, float)


def _field(body: dict, name: str, types, default=None):
    """A request field of ``types``; absent or null: ``default``."""
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, types) or (isinstance(v, bool) and types is not bool):
        raise APIError(400, f"'{name}' has the wrong type ({type(v).__name__})", param=name)
    return v


# OpenAI fields this server does not implement, with the values that mean "off": anything else is a 400 rather
# than a reply that silently ignores what was asked
_UNSUPPORTED = {"logprobs": (None, False), "top_logprobs": (None,), "presence_penalty": (None, 0, 0.0),
                "frequency_penalty": (None, 0, 0.0), "logit_bias": (None, {}), "echo": (None, False),
                "best_of": (None, 1), "tools": (None, []), "tool_choice": (None, "none", "auto"),
                "response_format": (None, {"type": "text"}), "suffix": (None, "")}


def sampling_params(body: dict, chat: bool = False) -> SamplingParams:
    """OpenAI request fields (and specserve's extensions) -> SamplingParams; 400 on bad values. Without a
    token limit a chat completion runs up to the context length and a completion stops at 16 (OpenAI's
    defaults)."""
    n = _field(body, "n", int, 1)
    if n != 1:
        raise APIError(400, "only n=1 is supported", param="n")
    for name, off in _UNSUPPORTED.items():
        if name in body and body[name] not in off:
            raise APIError(400, f"'{name}' is not supported by this server", param=name)
    max_tokens = _field(body, "max_completion_tokens", int)
    if max_tokens is None:
        max_tokens = _field(body, "max_tokens", int, None if chat else 16)
    stop = body.get("stop")
    if stop is not None and not (isinstance(stop, str) or (isinstance(stop, list) and
                                                          all(isinstance(s, str) for s in stop))):
        raise APIError(400, "'stop' must be a string or a list of strings", param="stop")
    try:
        return SamplingParams(
            temperature=float(_field(body, "temperature", _NUM, 1.0)), top_p=float(_field(body, "top_p", _NUM, 1.0)),
            top_k=_field(body, "top_k", int, -1), min_p=float(_field(body, "min_p", _NUM, 0.0)),
            seed=_field(body, "seed", int), max_tokens=max_tokens, stop=stop,
            stop_token_ids=_field(body, "stop_token_ids", list, []) or [],
            ignore_eos=bool(body.get("ignore_eos", False)),
            relaxed_acceptance=_field(body, "relaxed_acceptance", bool),
            relaxed_topk=_field(body, "relaxed_topk", int), relaxed_delta=_field(body, "relaxed_delta", _NUM),
        )
    except ValueError as e:
        raise APIError(400, str(e)) from None


def build_app(engine: AsyncEngine, model_name: str) -> FastAPI:
    app = FastAPI(title="specserve")
    metrics = ServerMetrics(engine.engine)
    tokenizer = engine.engine.tokenizer

    @app.exception_handler(APIError)
    async def _api_error(_req, e: APIError):
        metrics.rejected.labels(e.code or str(e.status)).inc()
        return e.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_req, e: StarletteHTTPException):  # unknown routes and methods, in OpenAI's body
        return await _api_error(_req, APIError(e.status_code, str(e.detail), code=str(e.status_code)))

    @app.exception_handler(Exception)
    async def _internal_error(_req, e: Exception):  # Starlette logs the traceback
        return await _api_error(_req, APIError(500, f"internal error: {type(e).__name__}: {e}",
                                               code="internal_error", kind="server_error"))

    async def _body(request: Request) -> dict:
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise APIError(400, f"request body is not valid JSON ({e})", code="invalid_json") from None
        if not isinstance(body, dict):
            raise APIError(400, "request body must be a JSON object")
        model = body.get("model")
        if model is not None and model != model_name:
            raise APIError(404, f"the model '{model}' does not exist; this server serves '{model_name}'",
                           param="model", code="model_not_found")
        return body

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
        if not (isinstance(prompt, str) or (isinstance(prompt, list) and all(isinstance(t, int) for t in prompt))):
            raise APIError(400, "'prompt' must be a string or a list of token ids (one prompt)", param="prompt")
        return await _serve(request, body, prompt, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await _body(request)
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise APIError(400, "'messages' must be a non-empty list of {role, content} objects", param="messages")
        try:  # each message checked, and text content parts joined, there (tokenizer.chat_message)
            prompt = tokenizer.apply_chat_template(msgs)
        except Exception as e:
            raise APIError(400, f"cannot apply the chat template: {e}", param="messages") from None
        return await _serve(request, body, prompt, chat=True)

    async def _serve(request: Request, body: dict, prompt, chat: bool):
        params = sampling_params(body, chat)
        stream = bool(body.get("stream", False))
        options = _field(body, "stream_options", dict, {})
        include_usage = bool(options.get("include_usage", False))
        cid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        obj = "chat.completion" if chat else "text_completion"
        gen = engine.generate(prompt, params)
        try:
            first = await gen.__anext__()
        except QueueFull as e:
            raise APIError(429, str(e), code="queue_full", kind="rate_limit_error") from None
        except ValueError as e:
            raise APIError(400, str(e), param="prompt" if "prompt" in str(e) else None) from None

        def choice(out, delta: bool, first_chunk: bool = False):
            text = out.delta_text if delta else out.text
            fin = out.finish_reason if out.finished else None
            if chat:
                if not delta:
                    return {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": fin,
                            "logprobs": None}
                msg = {"role": "assistant", "content": text} if first_chunk else {"content": text}
                return {"index": 0, "delta": msg, "finish_reason": fin, "logprobs": None}
            return {"index": 0, "text": text, "finish_reason": fin, "logprobs": None}

        if not stream:
            async def collect():
                out = first
                while not out.finished:
                    out = await gen.__anext__()
                return out

            task = asyncio.ensure_future(collect())
            while not task.done():  # a client that hangs up aborts its request (and frees its blocks)
                await asyncio.wait({task}, timeout=0.25)
                if not task.done() and await request.is_disconnected():
                    task.cancel()
                    await gen.aclose()
                    return Response(status_code=499)
            out = task.result()
            metrics.observe_finished(out)
            return {"id": cid, "object": obj, "created": created, "model": model_name, "choices": [choice(out, False)],
                    "usage": usage_of(out)}

        async def sse():
            out = first
            chunk_obj = "chat.completion.chunk" if chat else "text_completion"
            try:
                first_chunk = True
                while True:
                    payload = {"id": cid, "object": chunk_obj, "created": created, "model": model_name,
                               "choices": [choice(out, True, first_chunk)]}
                    first_chunk = False
                    if include_usage:
                        payload["usage"] = None
                    yield f"data: {json.dumps(payload)}\n\n"
                    if out.finished:
                        break
                    out = await gen.__anext__()
                metrics.observe_finished(out)
                if include_usage:
                    yield f"data: {json.dumps({'id': cid, 'object': chunk_obj, 'created': created, 'model': model_name, 'choices': [], 'usage': usage_of(out)})}\n\n"
                yield "data: [DONE]\n\n"
            except Exception as e:  # the status line is sent already: the error goes in the stream, then its end
                log.exception("stream failed")
                err = {"message": f"internal error: {type(e).__name__}: {e}", "type": "server_error",
                       "param": None, "code": "internal_error"}
                yield f"data: {json.dumps({'error': err})}\n\n"
                yield "data: [DONE]\n\n"
            finally:
                await gen.aclose()  # a client that went away aborts its request and frees its blocks

        return StreamingResponse(sse(), media_type="text/event-stream")

    return app
