"""Host-side cost of one engine step (scheduling, input building, result handling, detokenization) with the
device work replaced by a stub, so the figure is what the host adds to every step whatever the GPU does.

A tiny random model, B requests in the generation phase, graph layouts (padded, as on CUDA), 200 steps;
the stub (in place of the runner's ``launch``) chooses the step's draft length as the launch does (with
speculation), stages the step's inputs exactly as the runner does before a CUDA-graph replay (``stage_graph``: the
compact record and its upload) and returns one token (three with speculation where the step drafted) per row. "views" is what a graph capture adds on top (a replay does not): the record's device
views and the ops that expand them, run here eagerly on the CPU, timed separately and not part of the step
figure. Last, the heap's size and what a full collection of it costs unfrozen.

    python benchmarks/bench_host.py [--batch 1 64] [--steps 200] [--prompt-len 5] [--whole-record] [--final-only]
        [--zero-drafts | --adaptive]
"""

from __future__ import annotations

import argparse
import gc
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))

from specserve import LLM, RequestOutputKind, SamplingParams  # noqa: E402
from specserve.runner.cuda_graph import CudaGraphs  # noqa: E402
from specserve.runner.model_runner import Launched, RowResult  # noqa: E402
from specserve.speculative.step_costs import StepCosts  # noqa: E402
from tiny_models import make_head, make_hf_model  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--prompt-len", type=int, default=5, help="tokens per prompt")
    ap.add_argument("--final-only", action="store_true",
                    help="requests report only when they end (output_kind FINAL_ONLY, as LLM.generate asks)")
    ap.add_argument("--zero-drafts", action="store_true",
                    help="speculation with the adaptive draft length held at D = 0 (its probes aside): what a step "
                         "that drafts nothing adds over a plain engine's")
    ap.add_argument("--adaptive", action="store_true",
                    help="speculation with the adaptive draft length drafting (costs under which D = 4 pays): what "
                         "its choice adds to a step over a fixed D's")
    ap.add_argument("--whole-record", action="store_true",
                    help="stage every graph step's whole record (no in-place rewrite of the step before's)")
    a = ap.parse_args()
    root = Path(tempfile.mkdtemp())
    make_hf_model(root / "t", "llama", num_hidden_layers=1, hidden_size=32, intermediate_size=64,
                  max_position_embeddings=16384)  # no request reaches its end during the run
    make_head(root / "e3", root / "t", "eagle3", own_head=False, seed=1)
    print(f"{'speculation':<12}{'batch':>6}{'host ms/step':>14}{'of which inputs ms':>20}{'views ms':>10}")
    for spec in (False, True):
        llm = LLM(str(root / "t"), device="cpu", dtype="float32", max_num_seqs=max(a.batch),
                  speculative_config=dict(method="eagle3", draft_model=str(root / "e3"), max_draft_len=4,
                                          adaptive_draft_len=a.zero_drafts or a.adaptive) if spec else None)
        eng, runner = llm.engine, llm.engine.runner
        if spec and a.zero_drafts:  # costs under which drafting never pays
            runner.speculator.policy.costs = StepCosts([max(a.batch)], [[1e-3] + [1.0] * 4])
        if spec and a.adaptive:  # every D costs the same: the longest, of the most tokens, is chosen
            runner.speculator.policy.costs = StepCosts([max(a.batch)], [[1e-3] * 5])
            runner.speculator.policy.timed = False  # the costs as given
        runner.graphs = CudaGraphs(max(a.batch), runner._staging_buffers(), capture=False)
        real = runner.launch
        for b in a.batch:
            kind = RequestOutputKind.FINAL_ONLY if a.final_only else RequestOutputKind.CUMULATIVE
            sp = SamplingParams(temperature=0, max_tokens=10 ** 6, ignore_eos=True, output_kind=kind)
            reqs = [eng.requests[eng.add_request([1 + i % 5 for i in range(a.prompt_len)], sp)] for _ in range(b)]
            while min(r.num_output_tokens for r in reqs) < 2:  # prefill (in chunks), then generation
                eng.step()
            t_in: list[float] = []
            t_views: list[float] = []

            def stub(batch):
                if spec:  # the drafts the step proposes, as the runner's launch chooses them (which graphs exist and
                    # the rows' table width, kept for the launch's layout, included)
                    runner._width_memo = (None, None)
                    most = runner.speculator.plan_step(batch.scheduled, None, runner._graph_check(batch))
                    for s in batch.scheduled:
                        s.next_drafts = most
                if a.whole_record:
                    runner._last_record = None
                t0 = time.perf_counter()
                layout = runner.graph_layout(batch)
                step_spec = None if not spec or runner.speculator.drafts_nothing(batch.scheduled) else runner.speculator
                rec, switches = runner.stage_graph(batch, layout, step_spec)
                t1 = time.perf_counter()
                t_in.append(t1 - t0)
                runner.graph_batch(rec, switches, layout, batch.scheduled, step_spec)
                t_views.append(time.perf_counter() - t1)
                runner._width_memo = None
                return Launched(batch, None, [RowResult([7] * 3, [1, 2, 3, 4], s.num_drafts, 2)
                                              if spec and s.next_drafts > 0 else
                                              RowResult([7], [], s.num_drafts, 0) if spec else RowResult([7])
                                              for s in batch.scheduled])

            runner.launch = stub
            t0 = time.perf_counter()
            for _ in range(a.steps):
                eng.step()
            per = (time.perf_counter() - t0 - sum(t_views)) / a.steps
            assert len(t_in) == a.steps, "a step ran without the model (a request ended)"
            runner.launch = real
            for rid in list(eng.requests):
                eng.abort_request(rid)
            print(f"{'on' if spec else 'off':<12}{b:>6}{per * 1e3:>14.3f}{np.median(t_in) * 1e3:>20.3f}"
                  f"{np.median(t_views) * 1e3:>10.3f}")
    # what a full collection of this process's heap costs where nothing is frozen (the engine freezes what its
    # start made, so that such a collection does not fall inside a step)
    gc.unfreeze()
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        gc.collect()
        times.append(time.perf_counter() - t0)
    print(f"heap: {len(gc.get_objects())} objects; a full collection of it unfrozen {np.median(times) * 1e3:.0f} ms")


if __name__ == "__main__":
    main()
