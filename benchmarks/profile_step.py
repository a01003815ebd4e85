"""Where a generation step's GPU time goes: kernel by kernel, from an eager profile (CUDA only).

The engine runs eagerly (``enforce_eager``) under ``torch.profiler`` for ``--steps`` generation steps at batch
``--batch`` and context ``--context``; kernels are grouped by name and reported per step (count, microseconds).
The sum is the device's busy time per step: a CUDA-graph replay of the same step costs that plus the gaps
between kernels, so comparing it with ``specserve bench --steps`` separates slow kernels from many kernels.
``--graphs`` profiles the replays the engine really runs instead, and splits the device's timeline into
kernels, the gaps between a step's kernels and idle time between steps (the host's share). ``--prefill``
profiles the steps that compute ``--batch`` fresh prompts of ``--context`` tokens instead (after a first set of
prompts captured their graphs), with the engine's default token budget and without the overlap scheduler (each
step collected before the next launches), and times them on the host as well; with ``--cached-prefix N`` every
prompt starts with the same N tokens, which the first set computes and the profiled set finds cached.

    python benchmarks/profile_step.py --model random:llama-3.1-8b --draft random --forced-acceptance 1.64 \\
        --context 512 --json prof.json
    python benchmarks/profile_step.py --model /root/model.gguf --draft specserve/heads/smollm2-135m-eagle3
    python benchmarks/profile_step.py --model /root/model.gguf --no-spec
    python benchmarks/profile_step.py --summarize prof.json   # a saved timeline's per-layer kernel costs

The per-layer costs come from ``specserve.bench.timeline.layer_costs`` (tested in tests/test_bench.py).
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict

import torch

from specserve.bench.run import tree_config
from specserve.bench.timeline import format_layer_costs


def profile(llm, batch: int, context: int, steps: int, warmup: int = 5, timeline: bool = False,
            prefill: bool = False, cached_prefix: int = 0) -> dict:
    from specserve import SamplingParams

    eng = llm.engine
    g = torch.Generator().manual_seed(0)
    sp = SamplingParams(temperature=0, max_tokens=100_000, ignore_eos=True)
    vocab = eng.model_config.vocab_size
    wall_us = None

    # a document every prompt starts with: the first set of requests computes it, the second finds it cached
    prefix = torch.randint(10, vocab, (cached_prefix,), generator=g).tolist()

    def start() -> list:
        # fresh random prompts (after the prefix) each time, so that prefix caching finds nothing else to reuse
        for _ in range(batch):
            eng.add_request(prefix + torch.randint(10, vocab, (context,), generator=g).tolist(), sp)
        return list(eng.requests.values())

    def run_prompts(reqs: list) -> int:
        n = 0
        while not all(r.num_output_tokens >= 1 for r in reqs):  # the steps that compute the prompts
            eng.step()
            n += 1
        return n

    reqs = start()
    run_prompts(reqs)
    if prefill:  # the prompts' steps of a second set of requests, once the first set captured their graphs
        for r in list(eng.requests):
            eng.abort_request(r)
        reqs = start()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            steps = run_prompts(reqs)
            torch.cuda.synchronize()
        wall_us = (time.perf_counter() - t0) * 1e6  # the profiler's own overhead included
    else:
        while not all(r.num_output_tokens >= 2 for r in reqs):  # the first drafts
            eng.step()
        for _ in range(warmup):
            eng.step()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                eng.step()
            torch.cuda.synchronize()
    per: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    spans = []
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        per[e.name][0] += 1
        per[e.name][1] += e.time_range.elapsed_us()
        spans.append((e.time_range.start, e.time_range.end, e.name))
    rows = sorted(((n, c / steps, us / steps) for n, (c, us) in per.items()), key=lambda r: -r[2])
    # the device's timeline: gaps between one kernel's end and the next one's start, those of at most
    # ``idle_us`` counted as inside a step (launch latency between a graph's kernels), longer ones as idle
    # (the host's time between steps)
    spans.sort()
    gaps = [max(0.0, b[0] - a[1]) for a, b in zip(spans, spans[1:])]
    idle_us = 40.0
    # one step's kernels in launch order (the middle one of the steps, split where the device idled)
    cuts = [0] + [i + 1 for i, g in enumerate(gaps) if g > idle_us] + [len(spans)]
    mid = len(cuts) // 2 - 1
    one = spans[cuts[mid]:cuts[mid + 1]] if timeline and len(cuts) > 2 else []
    order = [{"name": n, "us": b - a, "gap_us": (a - one[i - 1][1]) if i else 0.0}
             for i, (a, b, n) in enumerate(one)]
    timeline = {"span_us_per_step": (spans[-1][1] - spans[0][0]) / steps if spans else 0.0,
                "gaps_in_steps_us_per_step": sum(g for g in gaps if g <= idle_us) / steps,
                "idle_us_per_step": sum(g for g in gaps if g > idle_us) / steps}
    for r in list(eng.requests):
        eng.abort_request(r)
    return {"batch": batch, "context": context, "steps": steps, "wall_us": wall_us, **timeline,
            "kernels_per_step": sum(r[1] for r in rows), "busy_us_per_step": sum(r[2] for r in rows),
            "kernels": [{"name": n, "count": c, "us": us} for n, c, us in rows], "timeline": order}


def print_layer_costs(order: list[dict]) -> None:
    line = format_layer_costs(order)
    if line:
        print(line)


def main() -> None:
    from specserve import LLM

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--draft", default=None, help="head folder or 'random'")
    ap.add_argument("--method", default="eagle3")
    ap.add_argument("--draft-len", type=int, default=4)
    ap.add_argument("--forced-acceptance", type=float, default=None)
    ap.add_argument("--tree", default=None, metavar="KxDxN[:B]",
                    help="draft a tree of top-K children a node, depth D, N nodes (as `specserve bench --tree`; :B the "
                         "tree at up to B rows, without it each step the tree or the chain by measured cost)")
    ap.add_argument("--no-spec", action="store_true")
    ap.add_argument("--adaptive-draft-len", action="store_true",
                    help="the adaptive draft length (the steps it chooses; --zero-drafts profiles steps of D = 0)")
    ap.add_argument("--zero-drafts", action="store_true",
                    help="every step drafts nothing (what a speculative engine's step of D = 0 costs, the adaptive "
                         "draft length's choice for a head that accepts nothing)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5,
                    help="generation steps before the profiled ones (with --adaptive-draft-len, past the first "
                         "probe at D = 0, 32 steps in, so that the profiled steps are D = 0 steps)")
    ap.add_argument("--cached-prefix", type=int, default=0, metavar="N",
                    help="with --prefill: every prompt starts with the same N random tokens, which the profiled "
                         "prompts find cached (a question over a cached document)")
    ap.add_argument("--prefill", action="store_true",
                    help="profile the steps that compute --batch prompts of --context tokens instead")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--kv-cache-memory", type=int, default=None)
    ap.add_argument("--graphs", action="store_true",
                    help="profile the CUDA-graph replays the engine runs (default: eager steps, kernel by kernel)")
    ap.add_argument("--timeline", action="store_true",
                    help="also list one step's kernels in launch order with their durations and the gaps before them")
    ap.add_argument("--json", default=None)
    ap.add_argument("--summarize", metavar="JSON", default=None,
                    help="only print the per-layer kernel costs of a timeline saved with --timeline --json")
    a = ap.parse_args()
    if a.summarize:
        with open(a.summarize) as f:
            print_layer_costs(json.load(f)["timeline"])
        return
    spec = None
    if not a.no_spec:
        spec = dict(method=a.method, draft_model=a.draft, max_draft_len=a.draft_len)
        if a.tree:
            spec.update(tree_config(a.tree))  # "KxDxN:B" keeps the tree at up to B rows
        if a.forced_acceptance is not None:
            spec["forced_acceptance"] = a.forced_acceptance
        if a.adaptive_draft_len:
            spec["adaptive_draft_len"] = True
    kw = {"kv_cache_memory_bytes": a.kv_cache_memory} if a.kv_cache_memory else {}
    if a.prefill:  # each step collected before the next launches, so the prompt's steps are profiled alone
        kw.update(async_output=False, overlap_scheduler=False)
    else:  # a generation step's whole context in one prompt step
        kw["max_num_batched_tokens"] = max(2048, a.context + 1)
    llm = LLM(a.model, enforce_eager=not a.graphs, speculative_config=spec, max_num_seqs=a.batch, **kw)
    if a.cached_prefix and not a.prefill:
        ap.error("--cached-prefix profiles prompt steps: give --prefill")
    if a.zero_drafts:
        if spec is None or a.tree:
            ap.error("--zero-drafts needs a chain's head")
        policy = llm.engine.runner.speculator.policy
        policy.adaptive = True  # a step's layout as wide as its own draft length
        policy.choose = lambda *args, **kw: 0
    res = profile(llm, a.batch, a.context, a.steps, warmup=a.warmup, timeline=a.timeline, prefill=a.prefill,
                  cached_prefix=a.cached_prefix)
    step_kind = ("no speculation" if a.no_spec else f"tree {a.tree}" if a.tree else "D = 0" if a.zero_drafts else
                 f"adaptive D <= {a.draft_len}" if a.adaptive_draft_len else f"D = {a.draft_len}")
    what = f"{res['steps']} prompt steps" if a.prefill else f"context {a.context}"
    if a.cached_prefix:
        what += f" of {a.context} tokens after {a.cached_prefix} cached"
    print(f"{res['kernels_per_step']:.0f} kernels, {res['busy_us_per_step']:.0f} us of device time per step "
          f"(batch {a.batch}, {what}, {step_kind})")
    if res["wall_us"] is not None:
        print(f"host time of the prompt steps: {res['wall_us']:.0f} us")
    print(f"device timeline per step: {res['span_us_per_step']:.0f} us, of which gaps between a step's kernels "
          f"{res['gaps_in_steps_us_per_step']:.0f} us and idle (> 40 us, the host) {res['idle_us_per_step']:.0f} us")
    for k in res["kernels"][:a.top]:
        print(f"{k['us']:9.1f} us  x{k['count']:5.1f}  {k['name'][:110]}")
    print_layer_costs(res["timeline"])
    for i, k in enumerate(res["timeline"]):
        print(f"{i:4d} {k['us']:7.2f} us  gap {k['gap_us']:6.2f}  {k['name'][:100]}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
