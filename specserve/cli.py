"""Command line: ``specserve generate|chat|serve|bench|train-draft`` (generate and chat run in ``terminal.py``)."""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import sys
from pathlib import Path

from specserve.train.cli import add_train_parser, cmd_train


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """--help shows each flag's default, except where there is none to show (None, an off switch) or the help
    text already says it."""

    def _get_help_string(self, action):
        text = action.help or ""
        if (not action.option_strings or "default" in text or action.default is None or action.default is False
                or action.default == argparse.SUPPRESS
                or isinstance(action, argparse._HelpAction)):
            return text
        return text + " (default: %(default)s)"


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    """The engine's flags (vLLM's spellings); their defaults are ``EngineArgs``' and ``SpeculativeConfig``'s."""
    from specserve.config import ATTENTION_BACKENDS, EngineArgs, default_cpu_threads
    from specserve.speculative.config import METHODS, SpeculativeConfig

    e, s = EngineArgs(), SpeculativeConfig()
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=e.model,
                   help="Hugging Face folder or .gguf file (default: the embedded SmolLM2-135M-Instruct)")
    g.add_argument("--dtype", default=e.dtype, help="auto (bf16 on CUDA, float32 on CPU), float32, float16, bfloat16")
    g.add_argument("--device", default=e.device, help="cuda or cpu (default: cuda when available)")
    g.add_argument("--max-model-len", type=int, default=e.max_model_len, help="context length (default: the model's)")
    g.add_argument("--max-num-seqs", type=int, default=e.max_num_seqs, help="most requests running at once")
    g.add_argument("--max-num-batched-tokens", type=int, default=e.max_num_batched_tokens,
                   help="token budget per step; longer prompts are prefilled in chunks")
    g.add_argument("--block-size", type=int, default=e.block_size, help="tokens per KV-cache block (a power of two)")
    g.add_argument("--kv-cache-memory", "--kv-cache-memory-bytes", type=int, default=e.kv_cache_memory_bytes,
                   help="KV cache size in bytes (default: on CUDA what --gpu-memory-utilization leaves; on the CPU "
                        "what --max-num-seqs sequences of --max-model-len tokens need, at most 2 GiB or an eighth "
                        "of the available memory, at least one sequence)")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=e.enable_prefix_caching,
                   help="share the KV of full blocks whose tokens (and all before them) a request repeats: a shared "
                        "system prompt or a conversation's history is computed once")
    g.add_argument("--num-kv-blocks", "--num-gpu-blocks-override", type=int, default=e.num_kv_blocks,
                   help="exact number of KV blocks (overrides the budget)")
    g.add_argument("--gpu-memory-utilization", type=float, default=e.gpu_memory_utilization,
                   help="fraction of the GPU's memory the engine may use: weights, activations and the KV cache, "
                        "which takes the rest (when --kv-cache-memory is not given)")
    g.add_argument("--enforce-eager", action="store_true",
                   help="no CUDA graph capture (graphs are used on CUDA only); steps keep the graphs' padded layouts")
    g.add_argument("--disable-async-output-proc", action="store_true",
                   help="detokenize and report each step before launching the next (default on CUDA: while "
                        "the device runs the next step)")
    g.add_argument("--disable-overlap-scheduler", action="store_true",
                   help="schedule each step after the one before has returned its tokens (default on CUDA with "
                        "graphs: the next step is prepared and launched while the device runs the current one)")
    g.add_argument("--attention-backend", default=e.attention_backend, choices=list(ATTENTION_BACKENDS),
                   help="paged attention. auto: the Triton kernel on CUDA (a prompt's first chunk through PyTorch "
                        "SDPA's causal kernel), SDPA elsewhere; triton: the kernel for every step; sdpa: PyTorch "
                        "SDPA (the reference)")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=e.tensor_parallel_size, metavar="N",
                   help="split the model's attention heads and MLP features over N ranks, one process each (N GPUs; "
                        "gloo processes on the CPU)")
    g.add_argument("--cpu-threads", type=int, default=e.cpu_threads, metavar="N",
                   help=f"torch intra-op threads on the CPU (default: {default_cpu_threads()}, measured in "
                        "docs/BENCHMARKS.md: more threads decoded slower on a small, busy machine)")
    sp = p.add_argument_group("speculative decoding")
    one = sp.add_mutually_exclusive_group()
    one.add_argument("--draft", default=None,
                     help="draft head folder (EAGLE-3 or MTP layout); the default model uses its shipped head")
    one.add_argument("--no-spec", action="store_true", help="turn speculative decoding off")
    sp.add_argument("--method", default=None, choices=list(METHODS),
                    help="draft head type (default: what the head's config.json says; the default model's shipped "
                         "heads: eagle3, or mtp for its MTP-Eagle head)")
    sp.add_argument("--draft-len", type=int, default=s.max_draft_len,
                    help="D, drafts proposed per step (speculative_config max_draft_len)")
    sp.add_argument("--topk", "--eagle-topk", type=int, default=s.topk,
                    help="dynamic draft trees: children a node expands at each of the --draft-len depths (1: a "
                         "chain of drafts)")
    sp.add_argument("--max-total-draft-tokens", type=int, default=None,
                    help="nodes of a draft tree the target verifies (default: topk x draft-len, at most 63)")
    sp.add_argument("--tree-max-batch-size", type=int, default=None, metavar="B",
                    help="draft trees: steps of more than B rows draft a chain (default: each step the tree or the "
                         "chain of more expected tokens per second, by step costs measured at start on CUDA graphs; "
                         "8 rows elsewhere)")
    sp.add_argument("--draft-len-schedule", type=_schedule_arg, default=None, metavar="B:D[,B:D...]",
                    help="draft length by batch size (TensorRT-LLM's draft_len_schedule): a step of B rows drafts the "
                         "D of the smallest key >= B, none past the largest (e.g. 4:4,8:2,32:1)")
    sp.add_argument("--adaptive-draft-len", action="store_true",
                    help="each step drafts the D in 0..--draft-len of most expected tokens per second, from step costs "
                         "measured at start (a few seconds) and the acceptance its requests are getting")
    sp.add_argument("--step-cost-file", default=None, metavar="PATH",
                    help="keep --adaptive-draft-len's measured step costs in this JSON file between runs")
    sp.add_argument("--acceptance-rate-window-size", type=int, default=None, metavar="N",
                    help="speculation gate (with --acceptance-rate-threshold): stop drafting for good once the "
                         "acceptance rate over the last N speculative steps falls below the threshold")
    sp.add_argument("--acceptance-rate-threshold", type=float, default=None, metavar="RATE",
                    help="speculation gate: accepted / drafted in [0, 1]")
    sp.add_argument("--mtp-eagle", action=argparse.BooleanOptionalAction, default=None,
                    help="MTP: run one module D times (default when the head has fewer modules than D)")
    sp.add_argument("--relaxed-acceptance", action="store_true",
                    help="relaxed acceptance inside the thinking phase (lossy; needs --begin-thinking-token)")
    sp.add_argument("--relaxed-topk", type=int, default=s.relaxed_topk,
                    help="relaxed: drafts among the k most likely tokens")
    sp.add_argument("--relaxed-delta", type=float, default=s.relaxed_delta, help="relaxed: with p >= p(top1) - delta")
    sp.add_argument("--begin-thinking-token", default=None, help="token (id or text) that opens the thinking phase")
    sp.add_argument("--end-thinking-token", default=None, help="token (id or text) that closes the thinking phase")
    sp.add_argument("--forced-acceptance", type=float, default=None,
                    help="accept N drafts per step on average, whatever they are (a fraction alternates floor/ceil; "
                         "performance experiments only: output is NOT the model's)")


def _schedule_arg(value: str) -> dict[int, int]:
    """"4:4,8:2,32:1" -> {4: 4, 8: 2, 32: 1}."""
    try:
        return {int(b): int(d) for b, d in (part.split(":") for part in value.split(","))}
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected BATCH:DRAFT_LEN pairs separated by commas, got {value!r}")


def _token_arg(value: str | None) -> int | str | None:
    return int(value) if value is not None and value.isdigit() else value


def engine_args(a: argparse.Namespace):
    """The parsed engine flags -> ``EngineArgs``, the one place CLI names map to the engine's; nothing reads
    the namespace's engine flags after this (``EngineArgs.create_engine_config`` validates)."""
    from specserve.config import EngineArgs

    from specserve.loaders import is_default_model
    from specserve.speculative.config import SpeculativeConfig

    draft = a.draft
    if draft is None and not a.no_spec and is_default_model(a.model):  # the default model brings its own heads
        from specserve.heads import DEFAULT_HEADS

        draft = str(DEFAULT_HEADS[a.method or "eagle3"])
    if draft is None:  # speculation flags given where no head runs: said, not ignored
        s = SpeculativeConfig()
        given = [f for f, v, d in (("--method", a.method, None), ("--draft-len", a.draft_len, s.max_draft_len),
                                   ("--mtp-eagle", a.mtp_eagle, None), ("--relaxed-acceptance", a.relaxed_acceptance,
                                                                        False), ("--topk", a.topk, s.topk),
                                   ("--max-total-draft-tokens", a.max_total_draft_tokens, None),
                                   ("--tree-max-batch-size", a.tree_max_batch_size, None),
                                   ("--forced-acceptance", a.forced_acceptance, None),
                                   ("--draft-len-schedule", a.draft_len_schedule, None),
                                   ("--adaptive-draft-len", a.adaptive_draft_len, False),
                                   ("--step-cost-file", a.step_cost_file, None),
                                   ("--acceptance-rate-window-size", a.acceptance_rate_window_size, None),
                                   ("--acceptance-rate-threshold", a.acceptance_rate_threshold, None)) if v != d]
        if given:
            raise ValueError(f"{', '.join(given)} set but speculation is off ("
                             + ("--no-spec" if a.no_spec else "this model has no shipped head: give --draft") + ")")
    spec = None
    if draft is not None and not a.no_spec:
        spec = dict(method=a.method, draft_model=draft, max_draft_len=a.draft_len, topk=a.topk,
                    max_total_draft_tokens=a.max_total_draft_tokens, tree_max_batch_size=a.tree_max_batch_size,
                    forced_acceptance=a.forced_acceptance, use_relaxed_acceptance_for_thinking=a.relaxed_acceptance,
                    relaxed_topk=a.relaxed_topk, relaxed_delta=a.relaxed_delta,
                    begin_thinking_phase_token=_token_arg(a.begin_thinking_token),
                    end_thinking_phase_token=_token_arg(a.end_thinking_token),
                    draft_len_schedule=a.draft_len_schedule, adaptive_draft_len=a.adaptive_draft_len,
                    step_cost_file=a.step_cost_file, acceptance_rate_window_size=a.acceptance_rate_window_size,
                    acceptance_rate_threshold=a.acceptance_rate_threshold)
        if a.mtp_eagle is not None:
            spec["mtp_eagle"] = a.mtp_eagle
    return EngineArgs(model=a.model, dtype=a.dtype, device=a.device, max_model_len=a.max_model_len,
                      max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.max_num_batched_tokens,
                      block_size=a.block_size, kv_cache_memory_bytes=a.kv_cache_memory,
                      gpu_memory_utilization=a.gpu_memory_utilization, num_kv_blocks=a.num_kv_blocks,
                      enable_prefix_caching=a.enable_prefix_caching,
                      speculative_config=spec, enforce_eager=a.enforce_eager, attention_backend=a.attention_backend,
                      async_output=False if a.disable_async_output_proc else None,
                      overlap_scheduler=False if a.disable_overlap_scheduler else None, cpu_threads=a.cpu_threads,
                      tensor_parallel_size=a.tensor_parallel_size)


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    """The sampling flags of ``generate`` and ``chat`` (vLLM's spellings), and the chat template's."""
    s = p.add_argument_group("sampling")
    s.add_argument("--max-tokens", type=int, default=256, help="most tokens to generate per reply")
    s.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    s.add_argument("--top-p", type=float, default=1.0)
    s.add_argument("--top-k", type=int, default=-1, help="-1: off")
    s.add_argument("--min-p", type=float, default=0.0)
    s.add_argument("--seed", type=int, default=None)
    s.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    s.add_argument("--stop-token-ids", type=int, nargs="+", default=None,
                   help="token ids that end a request (put the prompts before this flag)")
    s.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--system", default=None, help="system message for the chat template")
    p.add_argument("-v", "--verbose", action="store_true", help="log engine setup")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specserve", description="LLM inference with one-model speculative decoding",
                                     formatter_class=_HelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate replies to prompts (chat template applied), streamed",
                         formatter_class=_HelpFormatter)
    gen.add_argument("prompts", nargs="+", help="prompts; '-' reads one prompt per line from stdin")
    _add_engine_args(gen)
    _add_sampling_args(gen)
    gen.add_argument("--no-chat-template", action="store_true", help="send prompts as raw text")
    gen.add_argument("--json", action="store_true", help="print one JSON object per prompt (at the end, not streamed)")
    gen.add_argument("--stats", action="store_true", help="print speed and speculation statistics to stderr")

    ch = sub.add_parser("chat", help="interactive multi-turn chat in the terminal (/reset, /stats, /exit)",
                        formatter_class=_HelpFormatter,
                        description="Chat with the model: replies stream as they are generated and the conversation "
                                    "is kept as history. /reset forgets it, /stats shows speed and speculation "
                                    "statistics, /exit or Ctrl-D quits; Ctrl-C stops a reply.")
    _add_engine_args(ch)
    _add_sampling_args(ch)

    sv = sub.add_parser("serve", help="OpenAI-compatible HTTP server", formatter_class=_HelpFormatter)
    sv.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                    help="model to serve, as `vllm serve MODEL` (the same as --model)")
    _add_engine_args(sv)
    from specserve.server.serve import add_server_args

    add_server_args(sv)  # --host, --port, limits, --api-key, --disable-log-requests, ... (server/serve.py)
    sv.add_argument("-v", "--verbose", action="store_true")

    add_train_parser(sub, _HelpFormatter)
    _bench_parser(sub)
    return parser


# Python names in engine / sampling errors -> the flags that set them (names not listed: "--" + dashes)
def _bench_parser(sub) -> None:
    from specserve.config import ATTENTION_BACKENDS

    b = sub.add_parser("bench", help="throughput and latency, speculation on/off, optionally against transformers",
                       formatter_class=_HelpFormatter,
                       description="Generates up to --max-tokens tokens per request (exactly that many with "
                                   "--ignore-eos) for each batch size, warmed up, median of --repeats; prints a "
                                   "table and writes bench.json, "
                                   "bench.md and bench.png under --out.")
    b.add_argument("--model", default=None,
                   help="HF folder, .gguf, or random:llama-3.1-8b / random:smollm2-135m (random weights of those "
                        "shapes); default: the embedded SmolLM2-135M-Instruct")
    b.add_argument("--prompts", nargs="*", default=[],
                   help="prompt files: JSONL/JSON with {prompt} (HumanEval too), {turns} (MT-bench), ShareGPT, ...")
    b.add_argument("--no-chat-template", action="store_true",
                   help="send file prompts as raw text (default: through the model's chat template, if it has one)")
    b.add_argument("--random-input-len", type=int, default=None, help="random token-id prompts of this length")
    b.add_argument("--num-prompts", type=int, default=64)
    b.add_argument("--batch-size", "--max-concurrency", dest="batch_size", type=int, nargs="+", default=[1],
                   metavar="N", help="requests in flight at once (continuous batching: max(N, --num-prompts) requests "
                                     "are submitted, at most N run together, a finished one's slot goes to the next); "
                                     "one measurement per value")
    b.add_argument("--max-tokens", type=int, default=256)
    b.add_argument("--ignore-eos", action="store_true",
                   help="generate exactly --max-tokens per request (default: stop at end of sequence, as users do)")
    b.add_argument("--speculative", default="both", choices=["on", "off", "both"])
    b.add_argument("--method", default="eagle3", choices=["eagle3", "mtp"])
    b.add_argument("--draft", default=None, help="head folder, or 'random' (timing only; use --forced-acceptance)")
    b.add_argument("--draft-len", type=int, default=4)
    b.add_argument("--forced-acceptance", type=float, default=None,
                   help="accept this many drafts per step on average (throughput at a given acceptance length)")
    b.add_argument("--dtype", default="auto")
    b.add_argument("--device", default=None)
    b.add_argument("--repeats", type=int, default=3)
    b.add_argument("--rounds", type=int, default=1,
                   help="run the specserve engines alternately this many times (without, then with speculation), "
                        "each built, warmed up and timed --repeats times afresh; rows report the median round, ratios "
                        "also the median of the per-round ratios (a machine's speed drifts between runs)")
    b.add_argument("--interleave", action="store_true",
                   help="build the specserve engines together and run them side by side: at each batch size every "
                        "engine's warm-up, then their timed runs in turn, so that a drift of the machine's speed "
                        "reaches them alike (each engine holds its own KV cache meanwhile: without --kv-cache-memory "
                        "they split the GPU's 90%%)")
    b.add_argument("--compare", nargs="*", default=[], choices=["hf", "hf-compile"],
                   help="also run transformers generate (eager / static cache + torch.compile) in this process")
    b.add_argument("--enforce-eager", action="store_true")
    b.add_argument("--disable-async-output-proc", action="store_true",
                   help="detokenize and report each step before launching the next")
    b.add_argument("--fixed-draft-lens", type=int, nargs="*", default=[], metavar="D",
                   help="also run chains of these fixed draft lengths beside --draft-len's, each an engine of its own")
    b.add_argument("--adaptive-draft-len", action="store_true",
                   help="also run an engine that chooses each step's draft length in 0..--draft-len "
                        "(speculative_config adaptive_draft_len)")
    b.add_argument("--tree", dest="trees", nargs="*", default=[], metavar="KxDxN",
                   help="also run these draft trees (topk x depth x total draft tokens, e.g. 4x5x24) beside the "
                        "chain of --draft-len drafts, each a speculative engine of its own; each step drafts the tree "
                        "or a chain by measured cost (CUDA graphs), or with :B after the shape (e.g. 4x5x24:64) the "
                        "tree at up to B rows (tree_max_batch_size)")
    b.add_argument("--prefix-caching", default="on", choices=["on", "off", "both"],
                   help="automatic prefix caching (the cache is emptied before each timed run: a run reuses only what "
                        "its own requests share); both: each engine with it, then without")
    b.add_argument("--shared-prefix-len", type=int, default=0, metavar="N",
                   help="put one common prefix of N random tokens before every prompt (many requests over one "
                        "document)")
    b.add_argument("--turns", type=int, default=1, metavar="N",
                   help="multi-turn conversations: each prompt starts one, and each of its N - 1 later turns sends the "
                        "whole history (the prompt, every reply, --turn-len new user tokens each turn) as a new request")
    b.add_argument("--turn-len", type=int, default=32, metavar="N", help="new user tokens of each later turn")
    b.add_argument("--overlap", default="on", choices=["on", "off", "both"],
                   help="the overlap scheduler (on CUDA with graphs); both: each engine with it, then without, "
                        "with the gain at each batch size")
    b.add_argument("--kv-cache-memory", type=int, default=None, help="KV cache bytes")
    b.add_argument("--attention-backend", default="auto", choices=list(ATTENTION_BACKENDS),
                   help="paged attention of every engine (as the engines' --attention-backend): auto, triton or sdpa")
    b.add_argument("--steps", type=int, nargs="*", default=None, metavar="BATCH",
                   help="also time decode / verify / draft-loop CUDA graphs at these batch sizes (CUDA, speculative)")
    b.add_argument("--steps-context", type=int, default=512, help="context length for --steps")
    b.add_argument("--out", default="bench-out", help="folder for bench.json, bench.md, bench.png")
    b.add_argument("-v", "--verbose", action="store_true")


def cmd_bench(a: argparse.Namespace) -> int:
    from specserve.bench.report import table, write_outputs
    from specserve.bench.run import BenchConfig, run_bench

    try:
        cfg = BenchConfig(model=a.model, prompts=a.prompts, random_input_len=a.random_input_len,
                          num_prompts=a.num_prompts, batch_sizes=a.batch_size, max_tokens=a.max_tokens,
                          ignore_eos=a.ignore_eos, speculative=a.speculative, method=a.method, draft=a.draft, draft_len=a.draft_len,
                          forced_acceptance=a.forced_acceptance, dtype=a.dtype, device=a.device, repeats=a.repeats,
                          rounds=a.rounds, interleave=a.interleave, compare=a.compare, enforce_eager=a.enforce_eager,
                          async_output=False if a.disable_async_output_proc else None, overlap=a.overlap,
                          trees=a.trees, fixed_draft_lens=a.fixed_draft_lens, adaptive=a.adaptive_draft_len,
                          prefix_caching=a.prefix_caching, shared_prefix_len=a.shared_prefix_len,
                          turns=a.turns, turn_len=a.turn_len,
                          kv_cache_memory_bytes=a.kv_cache_memory, attention_backend=a.attention_backend,
                          chat_template=not a.no_chat_template,
                          command=a.command_line, out=None)
        if a.steps:
            from specserve.bench.run import check_steps
            from specserve.config import resolve_device

            check_steps(cfg, resolve_device(cfg.device))  # before the long part, not after it
        result = run_bench(cfg)
        write_outputs(Path(a.out), result)  # kept even if the step timings below fail
        if a.steps:
            from specserve.bench.run import step_timings

            result["steps"] = step_timings(cfg, a.steps, a.steps_context, result["meta"]["copy_bandwidth_gbps"])
    except (ValueError, FileNotFoundError) as e:
        print(f"specserve: error: {e}", file=sys.stderr)
        return 2
    write_outputs(Path(a.out), result)
    print(table(result))
    print(f"\nwritten: {a.out}/bench.json, bench.md, bench.png")
    return 0


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    a.command_line = shlex.join(["specserve", *(sys.argv[1:] if argv is None else argv)])
    logging.basicConfig(level=logging.INFO if getattr(a, "verbose", False) else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    if a.command in ("generate", "chat", "serve"):
        from specserve.distributed import from_torchrun

        rank = from_torchrun()
        if rank is not None and rank.rank != 0:  # under torchrun: rank 0 runs the command, the others its steps
            return _serve_rank(a)
    if a.command in ("generate", "chat"):
        from specserve.terminal import cmd_chat, cmd_generate

        return cmd_generate(a) if a.command == "generate" else cmd_chat(a)
    if a.command == "train-draft":
        return cmd_train(a)
    if a.command == "serve":
        return cmd_serve(a)
    if a.command == "bench":
        return cmd_bench(a)
    return 2


def _serve_rank(a: argparse.Namespace) -> int:
    """A tensor-parallel rank other than 0 started by torchrun: the engine over its shard, running rank 0's steps."""
    from specserve import LLMEngine
    from specserve.distributed import serve_rank

    if getattr(a, "model_tag", None) is not None:
        a.model = a.model_tag
    serve_rank(LLMEngine(engine_args(a)))
    sys.stdout.flush()
    sys.stderr.flush()
    # leave as multiprocessing's children do, without the interpreter's finalization: a torchrun rank that ran it
    # aborted now and then ("terminate called without an active exception") in the process group's C++ threads
    os._exit(0)


def cmd_serve(a: argparse.Namespace) -> int:
    from specserve import LLMEngine
    from specserve.server.serve import run

    if a.model_tag is not None:
        if a.model is not None and a.model != a.model_tag:
            print(f"specserve: error: two models given: {a.model_tag} and --model {a.model}", file=sys.stderr)
            return 2
        a.model = a.model_tag

    def load():  # after the server's flags are checked
        engine = LLMEngine(engine_args(a))
        return engine, a.served_model_name or engine.model_path.name.removesuffix(".gguf")

    return run(a, load)


if __name__ == "__main__":
    sys.exit(main())
