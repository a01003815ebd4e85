"""The OpenAI request bodies as the server reads them: strict JSON (bounded nesting, no ``NaN``/``Infinity``),
strict field types, sampling parameters with OpenAI's ranges, chat messages; ``APIError`` carries OpenAI's error
body and status. ``ServerOptions`` are the limits these checks apply."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from specserve.sampling_params import SamplingParams
from specserve.tokenizer import chat_message

if TYPE_CHECKING:
    from fastapi.responses import JSONResponse


@dataclass
class ServerOptions:
    """The server's limits and switches (``specserve serve`` flags of the same names; see README)."""

    api_key: str | None = None  # required as ``Authorization: Bearer KEY`` on /v1/* when set
    enable_docs: bool = False  # /docs, /redoc and /openapi.json
    max_request_bytes: int = 4 << 20  # request bodies past this get 413
    max_prompt_chars: int | None = None  # None: 32 characters per token of the context, at least 65,536
    body_timeout: float = 30.0  # seconds to receive a request's body (408 past it)
    request_timeout: float | None = 600.0  # seconds a request may run (504 / an SSE error past it); None: no limit
    default_max_tokens: int | None = 4096  # chat completions without max_tokens; None: up to the context
    max_max_tokens: int | None = None  # None: no cap beyond the context
    loopback_hosts_only: bool = False  # Host header must name a loopback address (set when bound to loopback)
    allowed_hosts: tuple[str, ...] = ()  # names accepted besides loopback ones (lowercase, no trailing dot)
    tokenizer_workers: int = 2
    log_requests: bool = True


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", close: bool = False) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.close = close  # the body was not read: end the connection after the reply

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    def response(self) -> "JSONResponse":
        from fastapi.responses import JSONResponse  # imported here: the CLI's parsers read this module's options

        headers = {"connection": "close"} if self.close else None

        return JSONResponse(self.body(), status_code=self.status, headers=headers)


_NUM = (int, float)
MAX_JSON_DEPTH = 32
MAX_TEMPERATURE = 2.0  # OpenAI's range is [0, 2]
ROLES = {"system", "developer", "user", "assistant"}  # "tool"/"function" messages need tools: unsupported


def body_field(body: dict, name: str, types, default=None):
    """A request field of ``types`` (a bool is not a number, a number or string not a bool); absent or null:
    ``default``. Floats must be finite."""
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, types) or (isinstance(v, bool) and types is not bool):
        want = {bool: "a boolean", int: "an integer", _NUM: "a number", list: "a list", dict: "an object",
                str: "a string"}.get(types, "another type")
        raise APIError(400, f"'{name}' must be {want}, got {type(v).__name__}", param=name)
    if isinstance(v, float) and not math.isfinite(v):
        raise APIError(400, f"'{name}' must be finite", param=name)
    return v


# OpenAI fields this server does not implement, with the values that mean "off": anything else is a 400 rather
# than a reply that silently ignores what was asked
_UNSUPPORTED = {"presence_penalty": (None, 0, 0.0),
                "frequency_penalty": (None, 0, 0.0), "logit_bias": (None, {}), "echo": (None, False),
                "best_of": (None, 1), "tools": (None, []), "tool_choice": (None, "none", "auto"),
                "functions": (None, []), "function_call": (None, "none", "auto"),
                "response_format": (None, {"type": "text"}), "suffix": (None, "")}


def sampling_params(body: dict, chat: bool = False, opts: ServerOptions | None = None) -> SamplingParams:
    """OpenAI request fields (and specserve's extensions) -> SamplingParams; 400 on bad values. Without a
    token limit a completion stops at 16 tokens (OpenAI's default) and a chat completion at
    ``default_max_tokens`` (4,096 unless set; never past the context)."""
    opts = opts or ServerOptions()
    n = body_field(body, "n", int, 1)
    for name, off in _UNSUPPORTED.items():
        if name in body and body[name] not in off:
            raise APIError(400, f"'{name}' is not supported by this server", param=name)
    max_tokens = body_field(body, "max_completion_tokens", int)
    name = "max_completion_tokens"
    if max_tokens is None:
        max_tokens, name = body_field(body, "max_tokens", int, None), "max_tokens"
    if max_tokens is None:
        max_tokens = opts.default_max_tokens if chat else 16
    elif opts.max_max_tokens is not None and max_tokens > opts.max_max_tokens:
        raise APIError(400, f"'{name}' is {max_tokens}; this server allows at most {opts.max_max_tokens}",
                       param=name)
    stop = body.get("stop")
    if stop is not None and not (isinstance(stop, str) or (isinstance(stop, list) and
                                                          all(isinstance(s, str) for s in stop))):
        raise APIError(400, "'stop' must be a string or a list of strings", param="stop")
    temperature = float(body_field(body, "temperature", _NUM, 1.0))
    if not 0.0 <= temperature <= MAX_TEMPERATURE:
        raise APIError(400, f"'temperature' must be in [0, {MAX_TEMPERATURE:g}], got {temperature:g}",
                       param="temperature")
    logprobs = _logprobs_field(body, chat)
    stop_ids = body_field(body, "stop_token_ids", list, [])
    if any(not isinstance(t, int) or isinstance(t, bool) for t in stop_ids):
        raise APIError(400, "'stop_token_ids' must be a list of integers", param="stop_token_ids")
    try:
        return SamplingParams(
            temperature=temperature, top_p=float(body_field(body, "top_p", _NUM, 1.0)),
            top_k=body_field(body, "top_k", int, -1), min_p=float(body_field(body, "min_p", _NUM, 0.0)),
            seed=body_field(body, "seed", int), max_tokens=max_tokens, stop=stop,
            stop_token_ids=stop_ids, ignore_eos=body_field(body, "ignore_eos", bool, False),
            relaxed_acceptance=body_field(body, "relaxed_acceptance", bool),
            relaxed_topk=body_field(body, "relaxed_topk", int), relaxed_delta=body_field(body, "relaxed_delta", _NUM),
            logprobs=logprobs, n=n,
        )
    except ValueError as e:
        raise APIError(400, str(e)) from None


def _logprobs_field(body: dict, chat: bool) -> int | None:
    """OpenAI's log-probability fields -> ``SamplingParams.logprobs``: chat's ``logprobs`` (a boolean) and
    ``top_logprobs`` (0-20, with logprobs only); completions' ``logprobs`` (how many top tokens, 0-5)."""
    if chat:
        top = body_field(body, "top_logprobs", int)
        if not body_field(body, "logprobs", bool, False):
            if top is not None:
                raise APIError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
            return None
        if top is not None and not 0 <= top <= 20:
            raise APIError(400, f"'top_logprobs' must be in [0, 20], got {top}", param="top_logprobs")
        return top or 0
    k = body_field(body, "logprobs", int)
    if k is not None and not 0 <= k <= 5:
        raise APIError(400, f"'logprobs' must be in [0, 5], got {k}", param="logprobs")
    return k


def chat_logprobs(out, count: int, k: int) -> dict:
    """The last ``count`` tokens of a completion (``CompletionOutput``) with their log-probabilities in the chat API's
    shape (``choices[].logprobs``)."""
    def item(text: str, lp: float) -> dict:
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

    content = []
    for tok, entry in _last_entries(out, count):
        chosen = entry[tok]
        row = item(chosen.decoded_token, chosen.logprob)
        row["top_logprobs"] = [item(lp.decoded_token, lp.logprob) for lp in _top(entry, k)]
        content.append(row)
    return {"content": content}


def completion_logprobs(out, count: int, k: int, offset: int) -> dict:
    """The last ``count`` tokens of a completion (``CompletionOutput``) with their log-probabilities in the
    completions API's shape; ``offset``: the text's length before them."""
    tokens, lps, tops, offsets = [], [], [], []
    for tok, entry in _last_entries(out, count):
        chosen = entry[tok]
        offsets.append(offset)
        offset += len(chosen.decoded_token)
        tokens.append(chosen.decoded_token)
        lps.append(chosen.logprob)
        top: dict[str, float] = {}
        for lp in _top(entry, k):  # two tokens of one text (byte-level pieces): the likelier one
            top.setdefault(lp.decoded_token, lp.logprob)
        tops.append(top if k else None)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def _last_entries(out, count: int):
    ids, entries = out.token_ids, out.logprobs or []
    n = min(count, len(entries))
    return list(zip(ids[len(ids) - n:], entries[len(entries) - n:]))


def _top(entry: dict, k: int) -> list:
    return sorted((lp for lp in entry.values() if lp.rank is not None and lp.rank <= k), key=lambda lp: lp.rank)


def _json_depth_ok(obj, limit: int) -> bool:
    stack = [(obj, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, (dict, list)):
            if d > limit:
                return False
            stack.extend((x, d + 1) for x in (v.values() if isinstance(v, dict) else v))
    return True


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def parse_json(raw: bytes) -> dict:
    """A request body -> a JSON object; APIError 400 for bad JSON, NaN/Infinity, nesting past
    MAX_JSON_DEPTH (the parser's own recursion limit included) or a non-object."""
    try:
        body = json.loads(raw, parse_constant=_reject_constant)
    except RecursionError:
        body = None
        ok = False
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
        raise APIError(400, f"request body is not valid JSON ({e})", code="invalid_json") from None
    else:
        ok = _json_depth_ok(body, MAX_JSON_DEPTH)
    if not ok:
        raise APIError(400, f"request body nests deeper than {MAX_JSON_DEPTH} levels", code="invalid_json")
    if not isinstance(body, dict):
        raise APIError(400, "request body must be a JSON object", code="invalid_json")
    return body


def check_messages(msgs) -> int:
    """The chat messages' shape and roles (400 otherwise); returns their characters of content."""
    if not isinstance(msgs, list) or not msgs:
        raise APIError(400, "'messages' must be a non-empty list of {role, content} objects", param="messages")
    chars = 0
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise APIError(400, f"messages[{i}] must be a {{role, content}} object", param="messages")
        role = m.get("role")
        if role not in ROLES:
            raise APIError(400, f"messages[{i}]: unknown role {str(role)[:40]!r} (one of {', '.join(sorted(ROLES))})",
                           param="messages")
        for key in ("tool_calls", "function_call"):
            if m.get(key):
                raise APIError(400, f"messages[{i}]: '{key}' is not supported by this server", param="messages")
        try:
            chars += len(chat_message(m)["content"])
        except ValueError as e:
            raise APIError(400, f"messages[{i}]: {str(e)[:300]}", param="messages") from None
    return chars
