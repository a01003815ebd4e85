"""The adaptive draft length's choices replayed on the CPU with a GPU's step costs: the benchmark's own flow
(``bench.engine_run.EngineRun``: per-run counts, the overlap scheduler, a warm-up and timed runs) over the tests' tiny
target and EAGLE-3 head, with CUDA-graph layouts emulated (``CudaGraphs(capture=False)``: a layout that ran counts as
captured) and the policy's step costs set to the ones given, so that what the policy chooses (and the rent it pays
for graphs) can be compared with what the GPU engine chose, without a GPU. Prints each run's steps by proposed D.

    python benchmarks/replay_draft_len.py --batch 1 --costs-ms 0.515 0.639 0.667 0.702 0.701

``--measure MODEL`` instead prints the step costs an adaptive engine of MODEL with a random head measures at its
start, per batch bucket (on the GPU: the costs to replay).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))

from specserve.speculative.draft_len import StepCosts  # noqa: E402


def measure(model: str, max_rows: int) -> None:
    from specserve import LLM

    llm = LLM(model, max_num_seqs=max_rows, kv_cache_memory_bytes=4_000_000_000,
              speculative_config=dict(method="eagle3", draft_model="random", max_draft_len=4, adaptive_draft_len=True))
    costs = llm.engine.draft_policy.costs
    for b, s in zip(costs.buckets, costs.seconds):
        print(b, " ".join(f"{x * 1e3:.3f}" for x in s))


def replay(batch: int, costs_ms: list[float], runs: int, tokens: int) -> None:
    from specserve.bench.engine_run import EngineRun
    from specserve.bench.run import BenchConfig
    from specserve.runner.cuda_graph import CudaGraphs
    from tiny_models import make_target_and_eagle3

    root = Path(tempfile.mkdtemp())
    make_target_and_eagle3(root)
    cfg = BenchConfig(model=str(root / "target"), draft=str(root / "eagle3"), draft_len=len(costs_ms) - 1,
                      batch_sizes=[batch], max_tokens=tokens, ignore_eos=True, num_prompts=16, repeats=runs,
                      device="cpu", dtype="float32", adaptive=True)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 200, (128,), generator=g).tolist() for _ in range(16)]
    e = EngineRun(cfg, prompts, True, tree="adaptive")
    eng = e.eng
    eng.runner.graphs = CudaGraphs(batch, eng.runner._staging_buffers(), capture=False)
    eng.draft_policy.costs = StepCosts([batch], [[t * 1e-3 for t in costs_ms]])
    eng.draft_policy.timed = False  # the costs stay as given (the CPU's own periods are not the GPU's)
    for r in range(runs + 1):
        out = e.run(batch, timed=r > 0)
        st = out["stats"]
        print(f"{'warm-up' if r == 0 else f'run {r}'}: steps by proposed D {st.steps_by_draft_len}, "
              f"drafts accepted {st.num_accepted} of {st.num_drafted}", flush=True)
    e.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--costs-ms", type=float, nargs="+", default=[0.515, 0.639, 0.667, 0.702, 0.701],
                    help="milliseconds of a step of --batch rows at D = 0, 1, ...")
    ap.add_argument("--runs", type=int, default=3, help="timed runs after the warm-up")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--measure", metavar="MODEL", default=None)
    ap.add_argument("--max-rows", type=int, default=32, help="with --measure: the engine's max_num_seqs")
    a = ap.parse_args()
    if a.measure:
        measure(a.measure, a.max_rows)
    else:
        replay(a.batch, a.costs_ms, a.runs, a.max_tokens)


if __name__ == "__main__":
    main()
