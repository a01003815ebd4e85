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
built together and at each batch size their timed runs take turns (``bench_interleaved``).
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

from specserve.bench.summary import median_rounds, ratios, spec_label

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


def _captured(eng) -> int:
    """CUDA graphs the engine has captured so far."""
    return eng.runner.graphs.captures if eng.runner.graphs is not None else 0


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    k = (len(v) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


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


class EngineRun:
    """One specserve engine of a benchmark (speculation off, the chain, or ``tree``: a draft tree "KxDxN", a chain
    "D=k" of k drafts, or "adaptive", a chain whose draft length each step chooses), built once; ``run`` times one
    run at a batch size, ``row`` makes the figures of a batch size's runs (``bar``: a progress bar shared by several
    engines, else one of its own)."""

    def __init__(self, cfg: BenchConfig, prompt_ids: list[list[int]], spec: bool, label: str = "",
                 overlap: bool = True, tree: str | None = None, caching: bool = True, bar=None,
                 memory_share: float = 1.0) -> None:
        from specserve import LLM, SamplingParams
        from specserve.bench.steps import target_read_bytes
        from specserve.config import CacheConfig

        max_b = max(cfg.batch_sizes)
        kw = dict(dtype=cfg.dtype, device=cfg.device, max_num_seqs=max_b, enforce_eager=cfg.enforce_eager,
                  async_output=cfg.async_output, overlap_scheduler=overlap, enable_prefix_caching=caching,
                  max_num_batched_tokens=max(2048, max(len(p) for p in prompt_ids) + 1),
                  max_cuda_graph_batch_size=max_b, attention_backend=cfg.attention_backend)
        if cfg.kv_cache_memory_bytes:
            kw["kv_cache_memory_bytes"] = cfg.kv_cache_memory_bytes
        elif memory_share < 1:  # engines held together (``bench_interleaved``) split the GPU's share
            kw["gpu_memory_utilization"] = CacheConfig.gpu_memory_utilization * memory_share
        self.depth = cfg.draft_len
        if spec:
            kw["speculative_config"] = sc = _spec_config(cfg)
            if tree == "adaptive":
                sc.update(adaptive_draft_len=True)
            elif tree is not None and tree.startswith("D="):
                self.depth = int(tree[2:])
                sc.update(max_draft_len=self.depth)
            elif tree is not None:
                sc.update(tree_config(tree))
                self.depth = sc["max_draft_len"]
        self.kind = tree if tree == "adaptive" else ("chain " + tree) if tree and tree.startswith("D=") else \
            ("tree " + tree) if tree else spec
        self.cfg, self.prompt_ids, self.spec, self.caching = cfg, prompt_ids, spec, caching
        self.name = (f"specserve spec={spec_label(self.kind)}{'' if overlap else ' no overlap'}"
                     f"{'' if caching else ' no prefix cache'}{label}")
        # one tick per run (warm-ups included), on stderr: a run killed by a time limit shows where it was
        self.bar = bar or _progress(self.name, len(cfg.batch_sizes) * (cfg.repeats + 1))
        self.own_bar = bar is None
        self.bar.set_postfix_str("loading" if self.own_bar else f"loading {self.name}")
        self.llm = LLM(cfg.model, **kw)
        self.eng = self.llm.engine
        self.target_bytes = target_read_bytes(self.eng.model)  # read once per engine step
        self.sp = SamplingParams(temperature=0, max_tokens=cfg.max_tokens, ignore_eos=cfg.ignore_eos)

    def run(self, b: int, timed: bool = True, note: str = "") -> dict:
        """One run of max(b, prompts) requests at most ``b`` in flight (a warm-up where not ``timed``; ``note``:
        which run, for the progress bar) -> its seconds, outputs, steps, counts, prefix hit rate and graphs
        captured."""
        from specserve.core.metrics import SpecStats

        eng, dev = self.eng, self.eng.device
        batch = [{"prompt_token_ids": self.prompt_ids[i % len(self.prompt_ids)]}
                 for i in range(max(b, len(self.prompt_ids)))]
        eng.scheduler.cfg.max_num_seqs = b  # at most b requests in flight (the engine was sized for the largest)
        eng.spec_stats = SpecStats()
        eng.pool.reset_cache()  # every run computes its prompts afresh (but for what it shares within itself)
        steps0, graphs0 = eng.num_steps, _captured(eng)
        # the bar shows where a run killed by a time limit was (a shared bar: which engine too)
        self.bar.set_postfix_str(("" if self.own_bar else f"{self.name}: ") + f"batch {b} "
                                 + (note if timed else "warm-up"))
        _sync(dev)
        t0 = time.perf_counter()
        outs = _conversations(self.llm, batch, self.sp, self.cfg)
        _sync(dev)
        dt = time.perf_counter() - t0
        self.bar.update()
        return dict(seconds=dt, outs=outs, steps=eng.num_steps - steps0, stats=eng.spec_stats,
                    hit_rate=eng.pool.hit_rate, captured=_captured(eng) - graphs0)

    def row(self, b: int, runs: list[dict]) -> dict:
        """The figures of batch size ``b`` from its timed ``runs``: the median run's (of an even number the faster
        middle one: a pause of the host only ever slows a run)."""
        eng = self.eng
        runs = sorted(runs, key=lambda x: x["seconds"])
        med = runs[(len(runs) - 1) // 2]
        outs, st = med["outs"], med["stats"]
        # TTFT from admission: every request is submitted at once and waits for one of the b slots, which a
        # client at concurrency b would not count (the wait is reported apart as queue time)
        ttft = [(o.timings()["ttft_s"] - o.timings()["queue_s"]) * 1e3 for o in outs
                if o.timings().get("ttft_s") is not None and o.timings().get("queue_s") is not None]
        tpot = [o.timings()["tpot_s"] * 1e3 for o in outs if o.timings().get("tpot_s") is not None]
        n_tok = sum(len(o.token_ids) for o in outs)
        head = eng.head
        head_bytes = head.draft_read_bytes(self.depth, b) if head is not None else 0  # per draft loop (a tree's: more)
        row = dict(engine="specserve", speculative=self.kind, overlap=eng.overlap, prefix_caching=self.caching,
                   prefix_hit_rate=med["hit_rate"], batch=b, requests=len(outs), turns=self.cfg.turns,
                   new_tokens=round(n_tok / len(outs), 1),
                   seconds=med["seconds"], all_seconds=[x["seconds"] for x in runs],
                   tokens_per_s=n_tok / med["seconds"],
                   steps=med["steps"], step_ms=med["seconds"] / max(1, med["steps"]) * 1e3,
                   ttft_ms={p: _pct(ttft, q) for p, q in (("p50", .5), ("p90", .9), ("p99", .99))},
                   tpot_ms={p: _pct(tpot, q) for p, q in (("p50", .5), ("p90", .9), ("p99", .99))},
                   weight_bytes=self.target_bytes + head_bytes,
                   # weight bytes read per engine step (target once, the draft loop's D steps; KV reads not
                   # counted): a lower bound on traffic
                   achieved_weight_gbps=(self.target_bytes + head_bytes) * med["steps"] / med["seconds"] / 1e9,
                   first_tokens=outs[0].token_ids[:16],
                   graphs=eng.runner.graphs.num_captured if eng.runner.graphs is not None else 0,
                   # captured inside the timed runs (an eager step and a capture each, in their times)
                   timed_captures=sum(x["captured"] for x in runs))
        if self.spec:
            row.update(acceptance_length=st.acceptance_length, per_position_acceptance=st.per_position,
                       draft_len=self.depth, forced_acceptance=self.cfg.forced_acceptance,
                       steps_by_draft_len=st.steps_by_draft_len)
        log.info("%s batch=%d: %.1f tok/s", self.name, b, row["tokens_per_s"])
        return row

    def close(self) -> None:
        if self.own_bar:
            self.bar.close()
        dev = self.eng.device
        del self.llm, self.eng
        if dev.type == "cuda":
            torch.cuda.empty_cache()


def bench_specserve(cfg: BenchConfig, prompt_ids: list[list[int]], spec: bool, label: str = "",
                    overlap: bool = True, tree: str | None = None, caching: bool = True) -> list[dict]:
    """One engine (``EngineRun``) at every batch size, a warm-up and ``repeats`` timed runs each -> rows; a row's
    ``speculative`` is False, True (the chain) or "tree KxDxN" / "chain D=k" / "adaptive"."""
    engine = EngineRun(cfg, prompt_ids, spec, label, overlap, tree, caching)
    rows = []
    for b in cfg.batch_sizes:
        engine.run(b, timed=False)
        rows.append(engine.row(b, [engine.run(b, note=f"run {r + 1}/{cfg.repeats}") for r in range(cfg.repeats)]))
    engine.close()
    return rows


def bench_interleaved(cfg: BenchConfig, prompt_ids: list[list[int]], engines: list[tuple], label: str = "") \
        -> list[dict]:
    """The engines of ``engines`` ((spec, tree, overlap, caching) each) built together and run side by side: at each
    batch size every engine's warm-up, then the timed runs in turn (engine 1, 2, ..., 1, 2, ...), so that a drift of
    the machine's speed reaches each engine's runs alike (without ``kv_cache_memory_bytes`` the engines split
    ``gpu_memory_utilization``) -> rows, engine by engine."""
    bar = _progress(f"specserve, {len(engines)} engines side by side{label}",
                    len(engines) * len(cfg.batch_sizes) * (cfg.repeats + 1))
    runs = [EngineRun(cfg, prompt_ids, spec, label, overlap, tree, caching, bar=bar, memory_share=1 / len(engines))
            for spec, tree, overlap, caching in engines]
    rows: list[list[dict]] = [[] for _ in runs]
    for b in cfg.batch_sizes:
        for e in runs:
            e.run(b, timed=False)
        timed: list[list[dict]] = [[] for _ in runs]
        for r in range(cfg.repeats):
            for e, mine in zip(runs, timed):
                mine.append(e.run(b, note=f"run {r + 1}/{cfg.repeats}"))
        for e, mine, out in zip(runs, timed, rows):
            out.append(e.row(b, mine))
    for e in runs:
        e.close()
    bar.close()
    return [r for out in rows for r in out]


def _conversations(llm, batch: list[dict], sp, cfg: BenchConfig) -> list:
    """Generate for ``batch``; with ``turns`` > 1 each request is the first turn of a conversation: every later turn's
    prompt is the whole history (the prompt before, its reply, ``turn_len`` new random user tokens), all
    conversations' turn k submitted together once turn k - 1 is done -> the outputs of every turn."""
    outs = llm.generate(batch, sp, use_tqdm=False)
    if cfg.turns == 1:
        return outs
    g = torch.Generator().manual_seed(cfg.seed + 2)
    vocab = llm.engine.model_config.vocab_size
    every = list(outs)
    for _ in range(cfg.turns - 1):
        batch = [{"prompt_token_ids": list(o.prompt_token_ids) + list(o.token_ids)
                  + torch.randint(10, vocab, (cfg.turn_len,), generator=g).tolist()} for o in outs]
        outs = llm.generate(batch, sp, use_tqdm=False)
        every += outs
    return every


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
