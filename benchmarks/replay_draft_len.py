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
from types import SimpleNamespace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))

from specserve.speculative.step_costs import StepCosts, measure_step_costs  # noqa: E402


def measure(model: str, max_rows: int) -> None:
    from specserve import LLM

    llm = LLM(model, max_num_seqs=max_rows, kv_cache_memory_bytes=4_000_000_000,
              speculative_config=dict(method="eagle3", draft_model="random", max_draft_len=4, adaptive_draft_len=True))
    costs = llm.engine.draft_policy.costs
    for b, s in zip(costs.buckets, costs.seconds):
        print(b, " ".join(f"{x * 1e3:.3f}" for x in s))


def replay(batch: int, costs_ms: list[float], runs: int, tokens: int, timed: bool = False,
           max_rows: int | None = None, model: str | None = None, switch_ms: float = 0.0) -> None:
    from specserve.bench.engine_run import EngineRun
    from specserve.bench.run import BenchConfig
    from specserve.runner.cuda_graph import CudaGraphs
    from tiny_models import make_target_and_eagle3

    if model is None:
        root = Path(tempfile.mkdtemp())
        make_target_and_eagle3(root)
        model, draft, vocab = str(root / "target"), str(root / "eagle3"), 200
    else:
        from specserve.loaders.random_model import random_config

        draft, vocab = "random", random_config(model).vocab_size
    cfg = BenchConfig(model=model, draft=draft, draft_len=len(costs_ms) - 1,
                      batch_sizes=sorted({batch, max_rows or batch}), max_tokens=tokens, ignore_eos=True,
                      num_prompts=16, repeats=runs, device="cpu", dtype="float32", adaptive=True)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, vocab, (128,), generator=g).tolist() for _ in range(16)]
    e = EngineRun(cfg, prompts, True, tree="adaptive")
    eng = e.eng
    eng.runner.graphs = CudaGraphs(max_rows or batch, eng.runner._staging_buffers(), capture=False)
    # the GPU engine's start-up measurement captures each D's graph at its context (256 tokens): those layouts run
    # here too, so that the same ones count as captured; then the given costs replace what it measured
    measure_step_costs(eng.runner, eng.pool, eng.runner.speculator.cost_options(True), [batch])
    eng.draft_policy.costs = StepCosts([batch], [[t * 1e-3 for t in costs_ms]])
    if timed:  # the policy observes step periods on a clock that each step advances by its GPU cost
        from specserve.speculative import draft_len
        clock = [0.0]
        draft_len.time = SimpleNamespace(perf_counter=lambda: clock[0])
        step, spec = eng._step, eng.runner.speculator

        def timed_step():
            before = {id(r) for r in eng.scheduler.running}
            out = step()
            clock[0] += costs_ms[min(spec.step_draft_len, len(costs_ms) - 1)] * 1e-3
            if {id(r) for r in eng.scheduler.running} != before:  # the host's work as requests end and start
                clock[0] += switch_ms * 1e-3
            return out
        eng._step = timed_step
    else:
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
    ap.add_argument("--timed", action="store_true",
                    help="the policy observes step periods (as the GPU engine does) on a clock that each step "
                         "advances by the given cost of its D")
    ap.add_argument("--switch-ms", type=float, default=0.0,
                    help="with --timed: milliseconds more on the clock after a step whose rows changed (the host's "
                         "work of ending a request and admitting the next)")
    ap.add_argument("--model", default=None, help="a random:NAME model with a random head instead of the tests' tiny "
                                                      "target and head")
    ap.add_argument("--measure", metavar="MODEL", default=None)
    ap.add_argument("--max-rows", type=int, default=None, help="the engine's max_num_seqs (replay: default --batch)")
    a = ap.parse_args()
    if a.measure:
        measure(a.measure, a.max_rows or 32)
    else:
        replay(a.batch, a.costs_ms, a.runs, a.max_tokens, a.timed, a.max_rows, a.model, a.switch_ms)


if __name__ == "__main__":
    main()
