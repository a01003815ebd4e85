"""Each engine step of a workload, traced: its wall time, rows, draft length, graph layouts, and whether it captured a
graph or ran eagerly (packed) -- what a throughput figure alone cannot tell apart (a capture mid-run, an eager step,
a slow host). One engine per mode, each running the chat prompts at one batch size: a warm-up run, then ``--runs``
timed runs; the last is traced (rows: those running when the step began; the prefix cache is not reset between
runs, so later runs find the prompts cached).

    python benchmarks/step_trace.py --model /root/model.gguf --draft specserve/heads/smollm2-135m-eagle3 \\
        --batch 64 --modes plain 4 2 adaptive

With the adaptive draft length each step also records what the policy weighed: the D it proposed, the expected
tokens and the step seconds by D for the step's rows, and the rent owed (``draft_len.prefer_captured``).
``--random-input-len N`` sends random prompts of N tokens instead of the chat prompts (a random model's word
vocabulary has no chat template), with ``--ignore-eos`` the replies run to ``--max-tokens``.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time

import torch

from specserve import LLM, SamplingParams
from specserve.bench.prompts import DEFAULT_PROMPTS
from specserve.speculative.draft_len import DraftLenPolicy


def trace_engine(llm: LLM, batch: list[dict], sp: SamplingParams, runs: int) -> tuple[float, list[dict]]:
    """-> (the last run's seconds, a record per step of it)."""
    eng = llm.engine
    runner, graphs = eng.runner, eng.runner.graphs
    cur: dict = {}
    launch, run, step = runner._launch, graphs.run if graphs is not None else None, eng._step

    def traced_run(key, fn, rerun=True):
        cur["layouts"].append(key[0])
        return run(key, fn, rerun)

    def traced_launch(sub, layout, spec):
        cur["eager"] += layout is None
        return launch(sub, layout, spec)

    trace: list[dict] = []
    spec = runner.speculator
    policy = spec.policy if spec is not None else None
    if isinstance(policy, DraftLenPolicy) and policy.adaptive:
        choose = policy.choose

        def traced_choose(requests, generation=False, captured=None, verifying=0):
            d = choose(requests, generation, captured, verifying)
            memo = policy._tokens_memo
            cur.update(proposed=d, tokens=None if memo is None else [round(float(t), 3) for t in memo.tokens],
                       step_ms=None if policy.live is None else
                       [round(t * 1e3, 3) for t in policy.live.row(len(requests))],
                       owed_ms=round(sum(policy.rent.owed.values()) * 1e3, 2),
                       graphs="-" if captured is None or captured.layout() is None else
                       "".join("1" if captured.has(k) else "0" for k in range(policy.max_draft_len + 1)))
            return d
        policy.choose = traced_choose

    def traced_step():
        cur.update(eager=0, layouts=[], proposed=None, tokens=None, step_ms=None, owed_ms=None, graphs=None)
        rows, captured = len(eng.scheduler.running), graphs.captures if graphs is not None else 0
        t0 = time.perf_counter()
        out = step()
        trace.append(dict(seconds=time.perf_counter() - t0, rows=rows,
                          draft_len=spec.step_draft_len if spec is not None else None,
                          captures=(graphs.captures if graphs is not None else 0) - captured, **cur))
        return out

    runner._launch, eng._step = traced_launch, traced_step
    if graphs is not None:
        graphs.run = traced_run
    sync = torch.cuda.synchronize if eng.device.type == "cuda" else (lambda: None)
    for _ in range(runs + 1):
        trace.clear()
        sync()
        t0 = time.perf_counter()
        llm.generate(batch, sp, use_tqdm=False)
        sync()
        seconds = time.perf_counter() - t0
    return seconds, trace


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--draft", default=None, help="the head folder (modes other than plain)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--modes", nargs="+", default=["plain", "4", "adaptive"],
                    help="plain, a fixed draft length, adaptive (D in 0..--draft-len each step), or 0 (adaptive held "
                         "at D = 0: steps that draft nothing)")
    ap.add_argument("--draft-len", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--show", type=int, default=8, help="steps printed one by one")
    ap.add_argument("--kv-cache-memory", type=int, default=4_000_000_000, help="KV cache bytes of each engine")
    ap.add_argument("--random-input-len", type=int, default=None, metavar="N",
                    help="random prompts of N tokens (one per row, seeded) instead of the chat prompts")
    ap.add_argument("--ignore-eos", action="store_true")
    a = ap.parse_args()
    sp = SamplingParams(temperature=0, max_tokens=a.max_tokens, ignore_eos=a.ignore_eos)
    for mode in a.modes:
        spec = None
        if mode != "plain":
            spec = dict(method="eagle3", draft_model=a.draft, max_draft_len=a.draft_len,
                        adaptive_draft_len=mode in ("adaptive", "0"))
            if mode not in ("adaptive", "0"):
                spec["max_draft_len"] = int(mode)
        llm = LLM(a.model, max_num_seqs=a.batch, max_cuda_graph_batch_size=a.batch, speculative_config=spec,
                  kv_cache_memory_bytes=a.kv_cache_memory)
        if mode == "0":  # the adaptive draft length held at D = 0: each step's layout as narrow as it can be
            llm.engine.runner.speculator.policy.choose = lambda *args, **kw: 0
        tok = llm.engine.tokenizer
        if a.random_input_len:
            g = torch.Generator().manual_seed(0)
            vocab = llm.engine.model_config.vocab_size
            ids = [torch.randint(10, vocab, (a.random_input_len,), generator=g).tolist() for _ in range(a.batch)]
        else:
            ids = [tok.apply_chat_template([{"role": "user", "content": t}]) if tok.has_chat_template else
                   tok.encode(t) for t in DEFAULT_PROMPTS]
        seconds, trace = trace_engine(llm, [{"prompt_token_ids": ids[i % len(ids)]} for i in range(a.batch)], sp,
                                      a.runs)
        print(f"=== {mode}, batch {a.batch}: {seconds * 1e3:.1f} ms, {len(trace)} steps")
        by = collections.defaultdict(list)
        for t in trace:
            by[(t["draft_len"], t["eager"], t["captures"])].append(t["seconds"])
        for (d, eager, cap), times in sorted(by.items(), key=str):
            print(f"  D={d} eager={eager} captures={cap}: {len(times)} steps, median "
                  f"{statistics.median(times) * 1e3:.3f} ms, {sum(times) * 1e3:.1f} ms in all")
        for t in trace[:a.show]:
            lay = ", ".join(f"{x.rows}x{x.q}/{x.table_width}{' prefill' if x.prefill else ''}" for x in t["layouts"])
            print(f"  {t['seconds'] * 1e3:7.3f} ms  rows {t['rows']}  D {t['draft_len']}  [{lay}]"
                  f"{'  eager' if t['eager'] else ''}{'  capture' if t['captures'] else ''}"
                  + ("" if t["proposed"] is None else f"  proposed {t['proposed']} tokens {t['tokens']} step ms "
                     f"{t['step_ms']} owed {t['owed_ms']} ms graphs {t['graphs']}"))
        weighed = [t for t in trace if t["proposed"] is not None]
        if weighed:  # the policy's view across the run: every show-th step
            print("  the policy's inputs across the run (step: proposed, expected tokens by D, step ms by D, owed ms, "
                  "which D have the step's graph)")
            for i in range(0, len(weighed), max(1, len(weighed) // a.show)):
                t = weighed[i]
                print(f"    {i:5d}: {t['proposed']}  {t['tokens']}  {t['step_ms']}  {t['owed_ms']}  {t['graphs']}")
        del llm


if __name__ == "__main__":
    main()
