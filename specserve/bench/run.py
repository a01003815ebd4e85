"""The benchmark driver: prompts -> (configuration x batch size) runs -> rows of figures -> JSON, markdown, PNG.

Every run generates up to ``max_tokens`` new tokens per request (exactly that many with ``ignore_eos``, as
vLLM's benchmarks spell it; otherwise each request stops at its end-of-sequence token, as a user's would, and
tokens/s counts the tokens generated) for max(batch, prompts) requests submitted together, at most ``batch`` of them
in flight (offline, continuous batching with ``max_num_seqs = batch``): batch 1 runs every prompt one after another,
so acceptance figures cover the whole prompt set whatever the batch size. transformers runs the same requests in
static batches of ``batch``. Each configuration is warmed up once per batch size (CUDA-graph capture, Triton
compilation, allocator growth), then timed ``repeats`` times with the device synchronised; the reported run is the
one with the median wall time (of an even number, the faster middle one: a pause of the host, such as another
tenant's work, only ever slows a run, and with two runs the slower one reported such a pause as the engine's speed).
With ``rounds`` > 1 the specserve engines run alternately that many times (each built, warmed up and timed afresh),
and each row reports the round with the median tokens/s (of an even number, the faster middle one: a row is one
real round); the ratios add the median of the per-round ratios (of an even number, the mean of the middle two),
since the machine's speed drifts between one engine's runs and the other's. With ``interleave`` the engines are
built together and at each batch size their timed runs take turns (``engine_run.bench_interleaved``).
"""

from __future__ import annotations

import logging
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from specserve.bench.summary import median_rounds, ratios

log = logging.getLogger("specserve")


@dataclass
class BenchConfig:
    model: str | None = None  # HF folder, .gguf, random:NAME, or None for the embedded default
    prompts: list[str] = field(default_factory=list)  # prompt files (JSONL/JSON shapes of train.prompts)
    random_input_len: int | None = None  # random token-id prompts of this length instead of files
    shared_prefix_len: int = 0  # a common prefix of this many random tokens before every prompt (one document)
    turns: int = 1  # multi-turn conversations: each prompt is followed by this many turns in all
    turn_len: int = 32  # the user's tokens of each turn after the first (random ids)
    num_prompts: int = 64
    batch_sizes: list[int] = field(default_factory=lambda: [1])
    max_tokens: int = 256
    ignore_eos: bool = False  # True: every request generates exactly max_tokens
    speculative: str = "both"  # on | off | both
    method: str = "eagle3"
    draft: str | None = None  # head folder, "random", or None: the shipped head for the default model
    draft_len: int = 4
    # draft trees to run besides the chain, each "KxDxN" (topk, depth, max_total_draft_tokens), ":B" after it:
    # tree_max_batch_size B (without: each step drafts the tree or a chain by measured cost, on CUDA graphs)
    trees: list[str] = field(default_factory=list)
    fixed_draft_lens: list[int] = field(default_factory=list)  # chains of these D besides draft_len's
    adaptive: bool = False  # also an engine choosing each step's D in 0..draft_len (adaptive_draft_len)
    forced_acceptance: float | None = None
    dtype: str = "auto"
    device: str | None = None
    repeats: int = 3
    rounds: int = 1  # specserve engines run alternately this many times (no speculation, speculation, ...)
    interleave: bool = False  # the specserve engines built together, their timed runs in turn at each batch size
    compare: list[str] = field(default_factory=list)  # hf, hf-compile
    enforce_eager: bool = False
    async_output: bool | None = None  # None: the engine's default (on CUDA)
    overlap: str = "on"  # the overlap scheduler: on | off | both (each engine run with it, then without)
    prefix_caching: str = "on"  # automatic prefix caching: on | off | both
    kv_cache_memory_bytes: int | None = None
    attention_backend: str = "auto"  # every specserve engine's (EngineArgs.attention_backend)
    chat_template: bool = True
    seed: int = 0
    command: str | None = None  # the command line, recorded in the outputs
    out: str | None = None

    def __post_init__(self) -> None:
        for name in ("speculative", "overlap", "prefix_caching"):
            if getattr(self, name) not in ("on", "off", "both"):
                raise ValueError(f"--{name.replace('_', '-')} must be on, off or both, got {getattr(self, name)!r}")
        if not isinstance(self.shared_prefix_len, int) or self.shared_prefix_len < 0:
            raise ValueError(f"--shared-prefix-len must be >= 0, got {self.shared_prefix_len!r}")
        if self.turns < 1 or self.turn_len < 1:
            raise ValueError(f"--turns and --turn-len must be >= 1, got {self.turns} and {self.turn_len}")
        for t in self.trees:
            tree_config(t)
        if any(not 1 <= d <= 16 for d in self.fixed_draft_lens):
            raise ValueError(f"--fixed-draft-lens takes draft lengths in [1, 16], got {self.fixed_draft_lens}")
        bad = [c for c in self.compare if c not in ("hf", "hf-compile")]
        if bad:
            raise ValueError(f"--compare takes hf and/or hf-compile, got {bad}")
        if not self.batch_sizes or min(self.batch_sizes) < 1:
            raise ValueError("--batch-size values must be >= 1")
        if self.max_tokens < 2 or self.repeats < 1 or self.rounds < 1:
            raise ValueError("--max-tokens must be >= 2, --repeats and --rounds >= 1")
        if not self.prompts and self.random_input_len is None and self.model is not None and \
                str(self.model).startswith("random:"):
            self.random_input_len = 128


def tree_shape(text: str) -> tuple[int, int, int]:
    """"KxDxN" -> (topk, depth, max_total_draft_tokens)."""
    try:
        k, d, n = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"--tree takes TOPKxDEPTHxTOTAL[:ROWS] (e.g. 4x5x24), got {text!r}") from None
    return k, d, n


def tree_config(text: str) -> dict:
    """"KxDxN" (each step drafts the tree or a chain by measured cost) or "KxDxN:B" (``tree_max_batch_size`` B:
    steps of up to B rows draft the tree, more a chain) -> its speculative_config fields."""
    shape, _, rows = text.partition(":")
    k, d, n = tree_shape(shape)
    out = dict(topk=k, max_draft_len=d, max_total_draft_tokens=n)
    if rows:
        if not rows.isdigit():
            raise ValueError(f"--tree takes TOPKxDEPTHxTOTAL[:ROWS] (e.g. 4x5x24:64), got {text!r}")
        out["tree_max_batch_size"] = int(rows)
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def load_prompt_ids(cfg: BenchConfig, tokenizer, vocab_size: int) -> list[list[int]]:
    """Token ids of the benchmark prompts (chat template applied to file prompts when the model has one), each after
    the shared prefix (``shared_prefix_len`` random tokens) where one is asked for."""
    prompts = _prompt_ids(cfg, tokenizer, vocab_size)
    if not cfg.shared_prefix_len:
        return prompts
    g = torch.Generator().manual_seed(cfg.seed + 1)
    prefix = torch.randint(10, vocab_size, (cfg.shared_prefix_len,), generator=g).tolist()
    return [prefix + p for p in prompts]


def _prompt_ids(cfg: BenchConfig, tokenizer, vocab_size: int) -> list[list[int]]:
    if cfg.prompts:
        from specserve.train.prompts import read_prompts

        texts = read_prompts(cfg.prompts)[:cfg.num_prompts]
        if not texts:
            raise ValueError("the prompt files hold no prompts")
        if cfg.chat_template and tokenizer.has_chat_template:
            return [tokenizer.apply_chat_template([{"role": "user", "content": t}]) for t in texts]
        return [tokenizer.encode(t) for t in texts]
    if cfg.random_input_len is None:
        from specserve.bench.prompts import DEFAULT_PROMPTS

        return [tokenizer.apply_chat_template([{"role": "user", "content": t}]) if tokenizer.has_chat_template
                else tokenizer.encode(t) for t in DEFAULT_PROMPTS[:cfg.num_prompts]]
    g = torch.Generator().manual_seed(cfg.seed)
    return [torch.randint(10, vocab_size, (cfg.random_input_len,), generator=g).tolist()
            for _ in range(cfg.num_prompts)]


def _spec_config(cfg: BenchConfig) -> dict | None:
    from specserve.heads import default_speculative_config

    if cfg.draft is None:
        if cfg.model not in (None, "default"):
            raise ValueError("--speculative on needs --draft HEAD (a head folder, or 'random' with "
                             "--forced-acceptance) for a model other than the embedded default")
        spec = default_speculative_config(cfg.method, cfg.draft_len)
    else:
        spec = dict(method=cfg.method, draft_model=cfg.draft, max_draft_len=cfg.draft_len)
    if cfg.forced_acceptance is not None:
        spec["forced_acceptance"] = cfg.forced_acceptance
    return spec


def _progress(desc: str, total: int):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="run", file=sys.stderr, dynamic_ncols=True)


def copy_bandwidth(device: torch.device, nbytes: int = 2 << 30, repeats: int = 20) -> float | None:
    """Device-to-device copy bandwidth in GB/s (bytes read + written), median of ``repeats``."""
    if device.type != "cuda":
        return None
    src = torch.empty(nbytes // 2, dtype=torch.float16, device=device).normal_()
    dst = torch.empty_like(src)
    times = []
    for i in range(repeats + 3):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        if i >= 3:
            times.append(a.elapsed_time(b) / 1e3)
    del src, dst
    return 2 * nbytes / statistics.median(times) / 1e9


def run_bench(cfg: BenchConfig) -> dict:
    from specserve.bench.engine_run import bench_interleaved, bench_specserve
    from specserve.config import resolve_device
    from specserve.loaders import load_config

    dev = resolve_device(cfg.device)
    mcfg = load_config(cfg.model)
    rows: list[dict] = []
    prompt_ids, tok = _prompts_for(cfg, mcfg)
    eos = mcfg.eos_token_ids or ((tok.eos_token_id,) if tok.eos_token_id is not None else ())  # as the engine
    order = {"on": [True], "off": [False], "both": [False, True]}
    for i in range(cfg.rounds):  # alternately: every round runs each engine afresh
        variants = [(spec, None) for spec in order[cfg.speculative]]
        if True in order[cfg.speculative]:
            variants += [(True, t) for t in cfg.trees]
            variants += [(True, f"D={d}") for d in cfg.fixed_draft_lens] + [(True, "adaptive")] * cfg.adaptive
        engines = [(spec, tree, overlap, caching) for spec, tree in variants
                   for overlap in order[cfg.overlap][::-1] for caching in order[cfg.prefix_caching][::-1]]
        label = f" round {i + 1}/{cfg.rounds}" if cfg.rounds > 1 else ""
        if cfg.interleave:
            rows += bench_interleaved(cfg, prompt_ids, engines, label)
            continue
        for spec, tree, overlap, caching in engines:
            rows += bench_specserve(cfg, prompt_ids, spec, label, overlap=overlap, tree=tree, caching=caching)
    rows = median_rounds(rows)
    extras: dict = {}
    for c in cfg.compare:
        try:
            from specserve.bench.hf import bench_hf

            rows += bench_hf(cfg, prompt_ids, compiled=c == "hf-compile", eos=tuple(eos))
        except Exception as e:  # a baseline that cannot run is reported, not fatal
            log.warning("%s baseline failed: %s", c, e)
            extras[f"{c}_error"] = f"{type(e).__name__}: {e}"
    bw = copy_bandwidth(dev)
    meta = dict(date=time.strftime("%Y-%m-%d %H:%M"), device=_device_name(dev), command=cfg.command,
                commit=_git_commit(), versions=_versions(bool(cfg.compare)), model=str(cfg.model or "default"),
                dtype=cfg.dtype, copy_bandwidth_gbps=bw, config=asdict(cfg), settings=_settings(dev), **extras)
    result = dict(meta=meta, rows=rows, ratios=ratios(rows))
    if cfg.out:
        from specserve.bench.report import write_outputs

        write_outputs(Path(cfg.out), result)
    return result


def _prompts_for(cfg: BenchConfig, mcfg):
    """-> (prompt token ids, the model's tokenizer)."""
    from specserve.loaders import resolve_model_path
    from specserve.loaders.random_model import is_random_ref, word_tokenizer
    from specserve.tokenizer import Tokenizer

    if is_random_ref(cfg.model):
        tok = Tokenizer(word_tokenizer(mcfg.vocab_size, mcfg.eos_token_ids[0]))
    else:
        path = resolve_model_path(cfg.model)
        tok = Tokenizer.from_gguf(path) if path.is_file() else Tokenizer.from_folder(path)
    return load_prompt_ids(cfg, tok, mcfg.vocab_size), tok


def _git_commit() -> str | None:
    """The checkout's commit (with ``+dirty`` for uncommitted changes) when specserve runs from one."""
    import subprocess

    root = Path(__file__).resolve().parents[2]
    try:
        sha = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=10)
        if sha.returncode:
            return None
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return sha.stdout.strip() + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return None


def _settings(dev: torch.device) -> dict:
    """What changes the engine's kernels without a flag: the SPECSERVE_* variables set, and whether its Triton
    kernels launch with programmatic dependent launch (``kernels.pdl``)."""
    from specserve.kernels import pdl

    out = {k: v for k, v in sorted(os.environ.items()) if k.startswith("SPECSERVE_")}
    out["pdl"] = dev.type == "cuda" and pdl.pdl(torch.empty(0, device=dev))
    return out


def _versions(with_transformers: bool) -> dict:
    import specserve
    from specserve.kernels._triton import HAVE_TRITON, triton

    out = dict(specserve=specserve.__version__, torch=torch.__version__,
               triton=triton.__version__ if HAVE_TRITON else None, cuda=torch.version.cuda)
    if with_transformers:
        import transformers

        out["transformers"] = transformers.__version__
    return out


def _device_name(dev: torch.device) -> str:
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    return f"{platform.processor() or 'cpu'} ({torch.get_num_threads()} threads)"


def check_steps(cfg: BenchConfig, dev: torch.device) -> None:
    if dev.type != "cuda" or cfg.enforce_eager:
        raise ValueError("--steps times CUDA graphs: it needs a CUDA device and no --enforce-eager")


def step_timings(cfg: BenchConfig, batches: list[int], context: int, bandwidth_gbps: float | None) -> list[dict]:
    """Decode / verify / draft-loop graph times at each batch size (``steps.step_times``), CUDA only."""
    from specserve import LLM
    from specserve.bench.steps import step_times
    from specserve.config import resolve_device

    dev = resolve_device(cfg.device)
    check_steps(cfg, dev)
    spec = _spec_config(cfg)
    llm = LLM(cfg.model, dtype=cfg.dtype, device=cfg.device, max_num_seqs=max(batches),
              max_cuda_graph_batch_size=max(batches), speculative_config=spec,
              kv_cache_memory_bytes=cfg.kv_cache_memory_bytes, max_num_batched_tokens=max(2048, context + 1),
              attention_backend=cfg.attention_backend)
    out = [step_times(llm, b, context, bandwidth_gbps or copy_bandwidth(dev)) for b in batches]
    del llm
    torch.cuda.empty_cache()
    return out
