"""One specserve engine of a benchmark, built once and run at each batch size (``EngineRun``), and the two orders
``run_bench`` runs them in: one engine after another (``bench_specserve``), or all built together with their timed
runs in turn (``bench_interleaved``)."""

from __future__ import annotations

import logging
import time

import torch

from specserve.bench.run import BenchConfig, _progress, _spec_config, _sync, tree_config
from specserve.bench.summary import spec_label

log = logging.getLogger("specserve")


def _captured(eng) -> int:
    """CUDA graphs the engine has captured so far."""
    return eng.runner.graphs.captures if eng.runner.graphs is not None else 0


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    k = (len(v) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


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
