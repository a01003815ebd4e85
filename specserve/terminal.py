"""``specserve generate`` and ``specserve chat``: flags checked before any weights load (errors in flag names),
then replies streamed to the terminal as they are produced."""

from __future__ import annotations

import argparse
import dataclasses
import json
import signal
import sys
import threading
import time
from pathlib import Path

from specserve.cli import engine_args


_FLAGS = {"max_draft_len": "--draft-len", "draft_model": "--draft", "kv_cache_memory_bytes": "--kv-cache-memory",
          "num_blocks": "--num-kv-blocks", "use_relaxed_acceptance_for_thinking": "--relaxed-acceptance",
          "begin_thinking_phase_token": "--begin-thinking-token", "end_thinking_phase_token": "--end-thinking-token",
          "async_output": "--disable-async-output-proc", "overlap_scheduler": "--disable-overlap-scheduler",
          "max_num_seqs": "--max-num-seqs", "topk": "--topk"}


def cli_error(e: Exception) -> str:
    """An engine / sampling ``ValueError`` in the CLI's words: flag names instead of Python names."""
    import re

    from specserve.config import EngineArgs
    from specserve.sampling_params import SamplingParams
    from specserve.speculative.config import SpeculativeConfig

    names = {f.name for c in (EngineArgs, SpeculativeConfig, SamplingParams) for f in dataclasses.fields(c)}
    names |= set(_FLAGS)
    msg = str(e)
    msg = re.sub(r" \(or None[^)]*\)", "", msg)  # the Python API's None has no flag
    msg = re.sub(r"invalid sampling parameter (\w+)=", lambda m: f"invalid {m.group(1)} ", msg)

    def flag(m):
        name = m.group(1)
        if name not in names or ("_" not in name and not m.group(2)):  # plain words ("model") stay words
            return m.group(0)
        return _FLAGS.get(name, "--" + name.replace("_", "-")) + (" " if m.group(2) else "")

    msg = re.sub(r"(?<![-\w])([a-z][a-z0-9_]*)(=?)", flag, msg)
    msg = re.sub(r"\(--(\w[\w-]*)\)", r"(--\1)", msg)
    return msg


def _fail(e: Exception | str) -> int:
    print(f"specserve: error: {cli_error(e) if isinstance(e, Exception) else e}", file=sys.stderr)
    return 2


def sampling_params(a: argparse.Namespace):
    """The sampling flags -> validated ``SamplingParams`` (before any model loads)."""
    from specserve import SamplingParams

    return SamplingParams(temperature=a.temperature, top_p=a.top_p, top_k=a.top_k, min_p=a.min_p, seed=a.seed,
                          max_tokens=a.max_tokens, stop=a.stop, stop_token_ids=a.stop_token_ids or [],
                          ignore_eos=a.ignore_eos)


def _checked_engine(a: argparse.Namespace, with_prompts: bool):
    """Everything the flags alone can tell (prompts, sampling, the engine's config) checked before any weights
    load, then the engine built -> (engine, prompts, sampling params), or the exit status of a bad flag or a
    failed load (reported on stderr)."""
    try:
        prompts = _read_prompts(a) if with_prompts else []
        params = sampling_params(a)
        return build_engine(a, engine_args(a).create_engine_config()), prompts, params
    except (ValueError, FileNotFoundError) as e:
        return _fail(e)


def build_engine(a: argparse.Namespace, config):
    """Load the engine for a validated config, saying so on stderr (loading takes seconds on a CPU)."""
    from specserve import LLMEngine
    from specserve.loaders import DEFAULT_MODEL, is_default_model, is_random_ref, resolve_model_path
    from specserve.speculative.checkpoint import check_head_folder

    if not is_random_ref(config.model):  # (the engine checks these too; here before saying "loading")
        resolve_model_path(config.model)
    spec = config.speculative_config
    if spec is not None and spec.draft_model != "random":
        check_head_folder(spec.draft_model)
    name = DEFAULT_MODEL if is_default_model(config.model) else Path(str(config.model)).name
    head = f" + {spec.method} head (D={spec.max_draft_len})" if spec is not None else ""
    print(f"specserve: loading {name}{head} on {config.device} ...", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    engine = LLMEngine(config)
    print(f"specserve: loaded in {time.perf_counter() - t0:.1f} s (context {engine.max_model_len} tokens, KV cache "
          f"{engine.config.kv_capacity} tokens)", file=sys.stderr, flush=True)
    return engine


def _read_prompts(a: argparse.Namespace) -> list[str]:
    prompts: list[str] = []
    for p in a.prompts:
        prompts.extend(line.rstrip("\r\n") for line in sys.stdin if line.strip()) if p == "-" else prompts.append(p)
    if not prompts:
        raise ValueError("no prompts (stdin was empty)")
    empty = [i + 1 for i, p in enumerate(prompts) if not p.strip()]
    if empty:
        raise ValueError(f"prompt {empty[0]} of {len(prompts)} is empty")
    return prompts


def _chat_ids(tok, a: argparse.Namespace, messages: list[dict]) -> list[int]:
    return tok.apply_chat_template(([{"role": "system", "content": a.system}] if a.system else []) + messages)


class _CtrlC:
    """Around an engine step: a first Ctrl-C (SIGINT) is held until the step returns, then raised; a second one,
    for a step that does not return, is raised at once. Outside the main thread (tests) a no-op."""

    def __init__(self) -> None:
        self.pressed = False
        self._old = None

    def _handler(self, signum, frame) -> None:
        if self.pressed:
            raise KeyboardInterrupt
        self.pressed = True

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self._old = signal.signal(signal.SIGINT, self._handler)
        return self

    def __exit__(self, *exc) -> None:
        if self._old is not None:
            signal.signal(signal.SIGINT, self._old)
            self._old = None
        if self.pressed and exc[0] is None:
            raise KeyboardInterrupt


def _stream(engine, rids: list[str | None], write, start=None, end=None) -> dict[str, object]:
    """Run the engine until ``rids`` finish, writing each reply's text as it comes, in prompt order: the first
    unfinished reply streams, later ones are held until it ends (``start(i)`` / ``end(i, out)`` around reply i).
    Ctrl-C aborts what is left and re-raises. -> the final output of each request id."""
    held: dict[str, list[str]] = {r: [] for r in rids if r is not None}
    final: dict[str, object] = {}
    order = [i for i, r in enumerate(rids) if r is not None]
    cur = 0

    def advance():
        nonlocal cur
        while cur < len(order) and rids[order[cur]] in final:
            i = order[cur]
            write("".join(held[rids[i]]))
            if end:
                end(i, final[rids[i]])
            cur += 1
            if cur < len(order):
                if start:
                    start(order[cur])
                write("".join(held.pop(rids[order[cur]])))
                held[rids[order[cur]]] = []

    if order and start:
        start(order[0])
    stop = _CtrlC()
    try:
        while engine.has_unfinished_requests():
            with stop:  # Ctrl-C inside a step lets the step finish (the engine stays whole), then stops
                outs = engine.step()
            for out in outs:
                rid = out.request_id
                if rid not in held:
                    continue
                if cur < len(order) and rid == rids[order[cur]]:
                    write(out.delta_text)
                else:
                    held[rid].append(out.delta_text)
                if out.finished:
                    final[rid] = out
            advance()
    except BaseException:
        for r in held:
            if r not in final:
                engine.abort_request(r)
        raise
    return final


def cmd_generate(a: argparse.Namespace) -> int:
    got = _checked_engine(a, with_prompts=True)
    if isinstance(got, int):
        return got
    engine, prompts, params = got
    tok = engine.tokenizer
    rids: list[str | None] = []
    errors: dict[int, str] = {}
    for i, p in enumerate(prompts):
        req = p if a.no_chat_template or not tok.has_chat_template else _chat_ids(tok, a, [{"role": "user",
                                                                                         "content": p}])
        try:
            rids.append(engine.add_request(req, params))
        except ValueError as e:
            rids.append(None)
            errors[i] = cli_error(e)
            print(f"specserve: error: prompt {i + 1} {p[:40]!r}: {errors[i]}", file=sys.stderr)
    several = len(prompts) > 1
    out = sys.stdout

    def write(text: str) -> None:
        if text and not a.json:
            out.write(text)
            out.flush()

    def start(i: int) -> None:
        if several and not a.json:
            head = prompts[i] if len(prompts[i]) <= 60 else prompts[i][:57] + "..."
            out.write(f"[{i + 1}/{len(prompts)}] {head}\n")

    t0 = time.perf_counter()
    bar = None  # --json prints at the end: a progress bar on a terminal meanwhile
    if a.json and len(rids) - len(errors) > 1 and sys.stderr.isatty():
        from tqdm import tqdm

        bar = tqdm(total=len(rids) - len(errors), desc="generating", unit="req")

    def end(i: int, o) -> None:
        if bar is not None:
            bar.update(1)
        elif not a.json:
            out.write("\n\n" if several else "\n")
            out.flush()
    try:
        final = _stream(engine, rids, write, start, end)
    except KeyboardInterrupt:
        print("\nspecserve: interrupted", file=sys.stderr)
        return 130
    finally:
        if bar is not None:
            bar.close()
    elapsed = time.perf_counter() - t0
    outs = [final[r] for r in rids if r is not None]
    if a.json:
        for i, (prompt, rid) in enumerate(zip(prompts, rids)):
            if rid is None:
                print(json.dumps({"prompt": prompt, "error": errors[i], "finish_reason": "error"}))
                continue
            o = final[rid]
            obj = {"prompt": prompt, "text": o.text, "token_ids": o.token_ids, "finish_reason": o.finish_reason,
                   "stop_reason": o.outputs[0].stop_reason, "num_prompt_tokens": len(o.prompt_token_ids),
                   "timings": o.timings()}
            if o.spec is not None:
                obj["spec"] = o.spec.as_dict()
            print(json.dumps(obj))
    if a.stats:
        n = sum(len(o.token_ids) for o in outs)
        print(f"specserve: {_plural(len(outs), 'prompt')}, {_plural(n, 'token')} in {elapsed:.2f} s "
              f"({n / elapsed:.1f} tokens/s)", file=sys.stderr)
        if engine.spec_config is not None:
            print(f"specserve: speculation: {engine.spec_stats.summary()}", file=sys.stderr)
    return 1 if errors else 0


def _plural(n: int, word: str, many: str | None = None) -> str:
    return f"{n} {word if n == 1 else many or word + 's'}"


CHAT_HELP = "/reset forgets the conversation, /stats shows speed and speculation, /exit or Ctrl-D quits"


def cmd_chat(a: argparse.Namespace) -> int:
    got = _checked_engine(a, with_prompts=False)
    if isinstance(got, int):
        return got
    engine, _, params = got
    tok = engine.tokenizer
    if not tok.has_chat_template:
        return _fail("the model has no chat template; use `specserve generate --no-chat-template` for raw text")
    interactive = sys.stdin.isatty()
    if interactive:
        try:
            import readline  # noqa: F401  (line editing and history for input())
        except ImportError:
            pass
    print(f"specserve chat: {CHAT_HELP}", flush=True)
    history: list[dict] = []
    last = None  # (tokens, seconds) of the last reply
    turns = 0
    while True:
        try:
            line = input("> ")
        except EOFError:
            print()
            break
        except KeyboardInterrupt:
            print()
            break
        cmd = line.strip()
        if not cmd:
            continue
        if cmd in ("/exit", "/quit"):
            break
        if cmd == "/reset":
            history.clear()
            print("(conversation cleared)", flush=True)
            continue
        if cmd == "/stats":
            print(_chat_stats(engine, last, turns, history), flush=True)
            continue
        if cmd.startswith("/"):
            print(f"unknown command {cmd.split()[0]}: {CHAT_HELP}", flush=True)
            continue
        history.append({"role": "user", "content": line})
        try:
            rid = engine.add_request(_chat_ids(tok, a, history), params)
        except ValueError as e:
            history.pop()
            print(f"specserve: error: {cli_error(e)}" + (" (/reset starts a new conversation)" if history else ""),
                  flush=True)
            continue

        def write(text: str) -> None:
            sys.stdout.write(text)
            sys.stdout.flush()

        t0 = time.perf_counter()
        try:
            out = _stream(engine, [rid], write)[rid]
            text, n = out.text, len(out.token_ids)
        except KeyboardInterrupt:  # stop this reply, keep the conversation
            print("\n(reply stopped)", flush=True)
            history.pop()
            continue
        print(flush=True)
        last, turns = (n, time.perf_counter() - t0), turns + 1
        history.append({"role": "assistant", "content": text})
    return 0


def _chat_stats(engine, last, turns: int, history: list[dict]) -> str:
    lines = [f"{_plural(turns, 'reply', 'replies')} so far, {_plural(len(history) // 2, 'turn')} in the conversation"]
    if last is not None:
        n, dt = last
        lines.append(f"last reply: {_plural(n, 'token')} in {dt:.2f} s ({n / dt:.1f} tokens/s)")
    if engine.spec_config is None:
        lines.append("speculation: off")
    else:
        lines.append(f"speculation ({engine.spec_config.method}, D={engine.spec_config.max_draft_len}): "
                     f"{engine.spec_stats.summary()}")
    return "\n".join(lines)
