"""The command line as a user meets it (issue #47): --help with defaults, flag errors before any weights load,
the head's kind from its folder, the default model's head however the model is named, streaming to a terminal
and `specserve chat` driven through a pseudo-terminal, the detokenizer's held-back bytes, LLM's progress bar,
and the CPU defaults (threads, KV cache size)."""

from __future__ import annotations

import io
import json
import os
import pty
import re
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

from specserve.cli import build_parser, engine_args, main
from tiny_models import make_head, target_with_eagle3

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> Path:
    root = target_with_eagle3(tmp_path_factory.mktemp("cli_ux"))
    make_head(root / "mtp", root / "target", "mtp", seed=2)
    return root


# -- point 4: --help shows defaults --------------------------------------------------------------------------------
def _help(*cmd: str) -> str:
    sub = build_parser()._subparsers._group_actions[0].choices[cmd[0]]
    return " ".join(sub.format_help().split())  # argparse wraps lines: compare with single spaces


def test_help_shows_defaults():
    gen = _help("generate")
    for flag, default in (("--max-tokens", "256"), ("--draft-len", "4"), ("--temperature", "0.0"),
                          ("--max-num-seqs", "64"), ("--block-size", "16"), ("--cpu-threads", "1")):
        # the flag's help entry: the flag and its metavar outside the usage's brackets, to the next option
        entry = re.findall(rf"{re.escape(flag)} [A-Z_]+(?!\]).*?(?= --|$)", gen)[-1]
        assert f"(default: {default}" in entry, (flag, entry)
    assert "default: 8000" in _help("serve") and "(default: None)" not in gen
    assert "/reset" in _help("chat") and "--max-tokens" in _help("chat") and "--draft" in _help("chat")


# -- point 3: arguments checked before any weights load, in the CLI's words --------------------------------------
@pytest.fixture
def no_load(monkeypatch):
    """Loading a model (or a head) fails the test: the error must come first."""
    import specserve.engine.llm_engine as le

    def boom(*a, **k):
        raise AssertionError("a model was loaded before the arguments were checked")

    monkeypatch.setattr(le, "load_model", boom)
    monkeypatch.setattr(le, "load_draft_head", boom)


@pytest.mark.parametrize("argv, words", [
    (["generate", "hi", "--draft", "/nonexistent"], ["--draft", "/nonexistent", "not a folder"]),
    (["generate", "hi", "--draft-len", "0"], ["--draft-len", "got 0"]),
    (["generate", "hi", "", "--no-chat-template"], ["prompt 2 of 2 is empty"]),
    (["generate", "hi", "--max-tokens", "-5"], ["--max-tokens -5"]),
    (["generate", "hi", "--model", "/nonexistent.gguf"], ["/nonexistent.gguf", "not found"]),
    (["generate", "hi", "--cpu-threads", "0"], ["--cpu-threads"]),
    (["chat", "--top-p", "0"], ["--top-p 0"]),
    (["chat", "--model", "MODEL", "--draft-len", "3"], ["--draft-len", "give --draft"]),
])
def test_bad_arguments_fail_before_any_load(argv, words, dirs, no_load, capsys):
    argv = [str(dirs / "target") if x == "MODEL" else x for x in argv]
    assert main(argv + ["--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("specserve: error: ") and err.count("\n") == 1, err
    for w in words:
        assert w in err, (w, err)
    for python_name in ("max_draft_len", "draft_model", "max_tokens", "or None", "top_p", "cpu_threads"):
        assert python_name not in err


def test_conflicting_flags_are_rejected(no_load, capsys):
    with pytest.raises(SystemExit) as e:
        main(["generate", "hi", "--no-spec", "--draft", "/some/head"])
    assert e.value.code == 2
    assert "--no-spec" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--draft-len set but speculation is off"):
        engine_args(build_parser().parse_args(["generate", "hi", "--no-spec", "--draft-len", "3"]))


def test_head_kind_comes_from_its_folder(dirs, caplog):
    from specserve.speculative.checkpoint import head_kind
    from specserve.speculative.config import SpeculativeConfig

    assert head_kind(str(dirs / "mtp")) == "mtp" and head_kind(str(dirs / "eagle3")) == "eagle3"
    a = build_parser().parse_args(["generate", "x", "--model", str(dirs / "target"), "--draft", str(dirs / "mtp")])
    assert engine_args(a).create_engine_config().speculative_config.method == "mtp"  # no --method needed
    # a config.json that says nothing: the tensor names tell
    bare = dirs / "mtp-bare"
    bare.mkdir(exist_ok=True)
    (bare / "model.safetensors").write_bytes((dirs / "mtp" / "model.safetensors").read_bytes())
    (bare / "config.json").write_text(json.dumps({k: v for k, v in json.loads((dirs / "mtp" / "config.json")
                                                  .read_text()).items()
                                                  if k not in ("num_nextn_predict_layers", "model_type",
                                                               "architectures")}))
    assert SpeculativeConfig(draft_model=str(bare)).method == "mtp"
    # an EAGLE-3 config that copied its target's num_nextn_predict_layers is still EAGLE-3
    copied = dirs / "eagle3-copied"
    copied.mkdir(exist_ok=True)
    (copied / "config.json").write_text(json.dumps(dict(json.loads((dirs / "eagle3" / "config.json").read_text()),
                                                        num_nextn_predict_layers=1)))
    assert head_kind(str(copied)) == "eagle3"
    # the flag overrides, with a warning
    with caplog.at_level("WARNING", logger="specserve"):
        assert SpeculativeConfig(method="eagle3", draft_model=str(dirs / "mtp")).method == "eagle3"
    assert "overrides" in caplog.text


def test_mtp_head_runs_without_method_flag(dirs, capsys):
    rc = main(["generate", "Hello", "--model", str(dirs / "target"), "--draft", str(dirs / "mtp"), "--device", "cpu",
               "--max-tokens", "6", "--ignore-eos", "--no-chat-template", "--json"])
    assert rc == 0
    assert json.loads(capsys.readouterr().out)["spec"]["verify_steps"] > 0


def test_default_model_keeps_its_head_however_named():
    from specserve.heads import DEFAULT_HEADS
    from specserve.loaders import default_model_path

    try:
        path = default_model_path()
    except ValueError:
        pytest.skip("the default model is not installed")
    for model in ([], ["--model", str(path)], ["--model", "SmolLM2-135M-Instruct"], ["--model", "default"]):
        spec = engine_args(build_parser().parse_args(["generate", "x", *model])).speculative_config
        assert spec["draft_model"] == str(DEFAULT_HEADS["eagle3"]), model
    spec = engine_args(build_parser().parse_args(["generate", "x", "--model", str(path), "--method", "mtp"]))
    assert spec.speculative_config["draft_model"] == str(DEFAULT_HEADS["mtp"])
    assert engine_args(build_parser().parse_args(["generate", "x", "--no-spec"])).speculative_config is None


# -- point 1: streaming, labels, --stats, progress bar, no lone replacement character -----------------------------
def _pty_run(argv: list[str], inputs: list[tuple[bytes, bytes]] = (), timeout: float = 120, slow_steps: float = 0):
    """Run ``specserve ARGV`` (in a Python that can slow each engine step) on a pseudo-terminal; ``inputs`` are
    (wait for this output, then type this) pairs. -> (chunks of output with the time each arrived, exit status)."""
    code = ("import sys, time\n"
            "import specserve.engine.llm_engine as le\n"
            f"slow = {slow_steps!r}\n"
            "step = le.LLMEngine.step\n"
            "def slowed(self):\n"
            "    time.sleep(slow)\n"
            "    return step(self)\n"
            "if slow: le.LLMEngine.step = slowed\n"
            "from specserve.cli import main\n"
            "sys.exit(main(sys.argv[1:]))\n")
    pid, fd = pty.fork()
    if pid == 0:  # the child: stdin, stdout and stderr are the terminal
        os.chdir(ROOT)
        os.execv(sys.executable, [sys.executable, "-c", code, *argv])
    chunks: list[tuple[float, str]] = []
    pending = list(inputs)
    seen = ""
    end = time.monotonic() + timeout
    status = None
    try:
        while time.monotonic() < end:
            r, _, _ = select.select([fd], [], [], 0.05)
            if r:
                try:
                    data = os.read(fd, 4096)
                except OSError:  # the child closed the terminal
                    data = b""
                if not data:
                    break
                text = data.decode("utf-8", "replace")
                chunks.append((time.monotonic(), text))
                seen += text
            while pending and pending[0][0].decode() in seen:
                wait_for, typed = pending.pop(0)
                seen = seen.split(wait_for.decode(), 1)[1]
                os.write(fd, typed)
        _, status = os.waitpid(pid, 0)
    finally:
        if status is None:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
        os.close(fd)
    return chunks, os.waitstatus_to_exitcode(status) if status is not None else None


def test_generate_streams_to_a_terminal_and_labels_replies(dirs):
    chunks, rc = _pty_run(["generate", "Hello there", "World", "--model", str(dirs / "target"), "--no-spec",
                           "--device", "cpu", "--max-tokens", "12", "--ignore-eos", "--no-chat-template", "--stats"],
                          slow_steps=0.1)
    assert rc == 0, chunks
    out = "".join(c for _, c in chunks).replace("\r\n", "\n")
    assert "loading target" in out and "loaded in" in out  # load progress (stderr, the same terminal)
    assert "[1/2] Hello there\n" in out and "[2/2] World\n" in out and out.index("[1/2]") < out.index("[2/2]")
    assert "2 prompts, 24 tokens" in out
    # streamed: the first reply's text reached the terminal well before the run ended (12 steps of >= 0.1 s)
    first = next(t for t, c in chunks if "[1/2]" in c)
    last_reply = next(t for t, c in chunks if "2 prompts" in c)
    text_chunks = [t for t, c in chunks if first <= t < last_reply]
    assert len(text_chunks) >= 5, chunks  # arrived piece by piece, not in one write at the end
    assert last_reply - text_chunks[1] > 0.5, chunks


def test_generate_piped_prints_plain_text_and_says_one_prompt(dirs):
    proc = subprocess.run([sys.executable, "-m", "specserve.cli", "generate", "Hello", "--model", str(dirs / "target"),
                           "--no-spec", "--device", "cpu", "--max-tokens", "5", "--ignore-eos", "--no-chat-template",
                           "--stats"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert "[1/" not in proc.stdout and proc.stdout.endswith("\n") and proc.stdout.strip()
    assert "1 prompt, 5 tokens" in proc.stderr


def test_cut_reply_does_not_end_in_a_replacement_character(dirs):
    from specserve.tokenizer import IncrementalDetokenizer, Tokenizer

    tok = Tokenizer.from_folder(dirs / "target")
    ids = tok.encode("a € b")
    cut = next(i for i in range(1, len(ids)) if tok.decode(ids[:i]).endswith("\ufffd"))  # inside the €
    d = IncrementalDetokenizer(tok, [])
    streamed = "".join(d.add([x]) for x in ids[:cut]) + d.flush()
    assert streamed == d.text == "a " and "\ufffd" not in streamed
    d = IncrementalDetokenizer(tok, [])
    assert "".join(d.add([x]) for x in ids) + d.flush() == "a € b"


def test_llm_generate_shows_a_progress_bar_by_default(dirs, capsys):
    from specserve import LLM, SamplingParams

    llm = LLM(str(dirs / "target"), device="cpu", num_kv_blocks=32)
    sp = SamplingParams(max_tokens=2)
    llm.generate(["a", "b"], sp)
    assert "generating" in capsys.readouterr().err
    llm.generate(["a", "b"], sp, use_tqdm=False)
    llm.generate("a", sp)  # one prompt: nothing to count
    assert "generating" not in capsys.readouterr().err


# -- point 2: specserve chat -----------------------------------------------------------------------------------------
def test_chat_in_a_terminal(dirs):
    chat = ["chat", "--model", str(dirs / "target"), "--draft", str(dirs / "eagle3"), "--device", "cpu",
            "--max-tokens", "6", "--ignore-eos"]
    chunks, rc = _pty_run(chat, [(b"> ", b"Hello\n"), (b"> ", b"How are you?\n"), (b"> ", b"/stats\n"),
                                 (b"> ", b"/reset\n"), (b"> ", b"/stats\n"), (b"> ", b"\x04")])
    out = "".join(c for _, c in chunks).replace("\r\n", "\n")
    assert rc == 0, out
    assert "/reset" in out and "/exit" in out  # the help line
    stats = out.split("/stats\n")
    assert "2 replies so far, 2 turns in the conversation" in stats[1]  # history: two user turns answered
    assert "last reply: 6 tokens" in stats[1] and "speculation (eagle3, D=4): drafted" in stats[1]
    assert "(conversation cleared)" in out and "0 turns in the conversation" in stats[2]


def test_chat_exits_on_exit_and_keeps_history(dirs, monkeypatch, capsys):
    import specserve.engine.llm_engine as le

    prompts = []
    add = le.LLMEngine.add_request
    monkeypatch.setattr(le.LLMEngine, "add_request", lambda self, p, *a, **k: prompts.append(p) or add(self, p, *a, **k))
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hi\n\nagain\n/exit\nnever sent\n"))
    rc = main(["chat", "--model", str(dirs / "target"), "--no-spec", "--device", "cpu", "--max-tokens", "4",
               "--ignore-eos", "--system", "Be brief."])
    assert rc == 0 and len(prompts) == 2
    assert prompts[0] == prompts[1][:len(prompts[0])]  # the second turn's prompt holds the first turn
    assert len(prompts[1]) > len(prompts[0]) + 4  # ... and the reply to it


def test_ctrl_c_inside_a_step_stops_the_reply_after_it(dirs, monkeypatch, capsys):
    """SIGINT arriving in the middle of an engine step (here: between launching a step and collecting the one before)
    is held until the step returns; the reply stops, the conversation goes on, and the engine is whole: the next
    reply is the one a fresh engine gives, and every block is free."""
    import os
    import signal

    import specserve.engine.llm_engine as le

    engines, calls, returned = [], [], []
    step = le.LLMEngine.step

    def interrupted_step(self):
        engines.append(self)
        calls.append(1)
        if len(calls) == 3:  # inside the third step of the first reply
            os.kill(os.getpid(), signal.SIGINT)
        outs = step(self)
        returned.append(len(calls))
        return outs

    monkeypatch.setattr(le.LLMEngine, "step", interrupted_step)
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hi\nHi\n/exit\n"))
    rc = main(["chat", "--model", str(dirs / "target"), "--no-spec", "--device", "cpu", "--max-tokens", "8",
               "--ignore-eos", "--disable-async-output-proc"])
    out = capsys.readouterr().out
    assert rc == 0 and out.count("(reply stopped)") == 1
    assert 3 in returned  # the interrupted step ran to its end
    eng = engines[0]
    assert eng.pool.num_free == eng.pool.num_usable and not eng.has_unfinished_requests()


# -- point 6: CPU defaults -----------------------------------------------------------------------------------------------
def test_cpu_defaults(dirs, monkeypatch):
    import torch

    from specserve import LLM
    from specserve.cache import kv_cache
    from specserve.config import CacheConfig, EngineArgs

    before = torch.get_num_threads()
    try:
        import os
        cfg = EngineArgs(model=str(dirs / "target"), device="cpu").create_engine_config()
        # 1 thread where it was measured faster (2 cores); larger machines keep torch's default
        assert cfg.cpu_threads == (1 if (os.cpu_count() or 1) <= 2 else None)
        monkeypatch.setattr(os, "cpu_count", lambda: 2)
        assert EngineArgs(model=str(dirs / "target"), device="cpu").create_engine_config().cpu_threads == 1
        monkeypatch.setattr(os, "cpu_count", lambda: 64)
        assert EngineArgs(model=str(dirs / "target"), device="cpu").create_engine_config().cpu_threads is None
        monkeypatch.undo()
        llm = LLM(str(dirs / "target"), device="cpu", max_num_seqs=3, max_model_len=100, cpu_threads=2)
        assert torch.get_num_threads() == 2
        # the KV pool holds max_num_seqs sequences of max_model_len tokens (and padding block 0), not 2 GiB
        assert llm.engine.config.num_kv_blocks == 3 * -(-100 // 16) + 1
    finally:
        torch.set_num_threads(before)
    per_block, seq = 1 << 20, 10
    monkeypatch.setattr(kv_cache, "_available_memory", lambda: 1 << 40)
    assert kv_cache.cpu_kv_budget(CacheConfig(), per_block, 100, 64) == 2 << 30  # bounded by 2 GiB
    monkeypatch.setattr(kv_cache, "_available_memory", lambda: 8 * 50 * per_block)
    assert kv_cache.cpu_kv_budget(CacheConfig(), per_block, seq, 64) == 50 * per_block  # and by memory / 8
    monkeypatch.setattr(kv_cache, "_available_memory", lambda: 8 * per_block)
    # the caps hold even where one sequence needs more (the engine then lowers max_model_len)
    assert kv_cache.cpu_kv_budget(CacheConfig(), per_block, seq, 64) == 2 * per_block
    monkeypatch.setattr(kv_cache, "_available_memory", lambda: 1 << 40)
    assert kv_cache.cpu_kv_budget(CacheConfig(), per_block, 4096, 1) == 2 << 30  # a 64k-token context: the cap


def test_commands_other_than_serve_run_without_the_web_stack():
    """``generate`` and ``bench`` parse and start without FastAPI, Starlette or uvicorn installed (the GPU machine
    has torch but not them); ``serve`` alone imports them."""
    code = ("import sys\n"
            "for m in ('fastapi', 'starlette', 'uvicorn'): sys.modules[m] = None  # import fails\n"
            "from specserve.cli import build_parser\n"
            "print(build_parser().parse_args(['bench', '--batch-size', '2']).batch_size)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[2]", out.stderr[-2000:]
