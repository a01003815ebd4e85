"""Which CUDA graphs a burst workload captures in each of its runs, and what each capture costs (CUDA only).

Random weights of the default model's shapes (and, with ``--spec``, a random EAGLE-3 head with forced acceptance
2.58); ``--num-prompts`` random prompts of ``--prompt-len`` tokens, at most ``--batch`` in flight, ``--max-tokens``
new tokens each, the same workload ``--runs`` times. Each capture prints its layout, host switches and seconds
(synchronised before and after: the eager warm-up step, the capture, and on a fresh machine Triton's compilation);
each run prints its wall time.

    python benchmarks/capture_times.py [--batch 8] [--spec] [--runs 4]
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from specserve import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--spec", action="store_true", help="a random EAGLE-3 head, D = 4, forced acceptance 2.58")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=40)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=4)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("capture_times.py times CUDA graph captures: it needs a GPU")
    spec = dict(method="eagle3", draft_model="random", max_draft_len=4, forced_acceptance=2.58) if a.spec else None
    llm = LLM("random:smollm2-135m", max_num_seqs=a.batch, max_cuda_graph_batch_size=a.batch,
              kv_cache_memory_bytes=4_000_000_000, speculative_config=spec)
    graphs = llm.engine.runner.graphs
    run = graphs.run

    def timed(key, step, rerun=True):
        if key in graphs._graphs:
            return run(key, step, rerun)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = run(key, step, rerun)
        torch.cuda.synchronize()
        lay, switches = key[0], key[1]
        print(f"  capture: rows {lay.rows}, q {lay.q}, table {lay.table_width}, prefill {lay.prefill}, "
              f"from zero {lay.from_zero}, draft_len {switches.draft_len}: {time.perf_counter() - t0:.3f} s", flush=True)
        return out

    graphs.run = timed
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(a.prompt_len)]}
               for _ in range(max(a.batch, a.num_prompts))]
    params = SamplingParams(temperature=0, max_tokens=a.max_tokens, ignore_eos=True)
    for r in range(a.runs):
        llm.engine.pool.reset_cache()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        torch.cuda.synchronize()
        print(f"run {r}: {time.perf_counter() - t0:.3f} s", flush=True)


if __name__ == "__main__":
    main()
