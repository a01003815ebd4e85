"""Count the device operations of one engine step, by phase, on the CPU.

With Triton's interpreter the model takes the same path as on CUDA (Triton kernels, not their references),
so the counts stand for kernel launches inside a captured step: every ATen op that does work (views and
shape queries excluded) plus every Triton kernel launch. A counted figure, not a timing.

    python benchmarks/count_step_ops.py [--spec | --tree KxDxN [--chains]] [--draft-len 4]
        [--model random:smollm2-135m | HF_FOLDER]   # a small folder counts in seconds, the 135M shapes in minutes
"""

from __future__ import annotations

import argparse
import collections
import os

os.environ["TRITON_INTERPRET"] = "1"  # before Triton is imported

import torch  # noqa: E402
import triton.runtime.interpreter as interpreter  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes  # noqa: E402

from specserve import LLM, SamplingParams  # noqa: E402
from specserve.bench.run import tree_shape  # noqa: E402
from specserve.runner.cuda_graph import CudaGraphs  # noqa: E402

NOT_WORK = {"view", "_unsafe_view", "reshape", "as_strided", "t", "expand", "select", "slice", "unsqueeze",
            "squeeze", "permute", "transpose", "detach", "alias", "lift_fresh", "split", "unbind", "chunk",
            "split_with_sizes", "empty", "empty_strided", "empty_like", "_reshape_alias", "view_as", "expand_as",
            "sym_size", "sym_stride", "is_same_size", "numel", "size", "stride", "dim", "promote_types",
            "resolve_neg", "resolve_conj"}


class Counter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.phase = "prepare"
        self.counts: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in NOT_WORK:
            self.counts[(self.phase, name)] += 1
        return func(*args, **(kwargs or {}))


def wrap_phase(counter: Counter, obj, attr: str, during: str, after: str) -> None:
    fn = getattr(obj, attr)

    def run(*a, **k):
        counter.phase = during
        out = fn(*a, **k)
        counter.phase = after
        return out

    setattr(obj, attr, run)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="random:smollm2-135m")
    ap.add_argument("--spec", action="store_true", help="a speculative step (random EAGLE-3 head)")
    ap.add_argument("--draft-len", type=int, default=4)
    ap.add_argument("--tree", metavar="KxDxN", help="a draft tree's step instead (top-k, depth, nodes)")
    ap.add_argument("--chains", action="store_true",
                    help="with --tree: the tree engine's step that verifies and drafts a chain of D (as its choice "
                         "takes where the tree does not pay), to set beside --spec's chain engine step")
    ap.add_argument("--context", type=int, default=30)
    a = ap.parse_args()
    if a.chains and not a.tree:
        ap.error("--chains needs --tree")
    a.spec = a.spec or a.tree is not None
    kw = dict(speculative_config=dict(method="eagle3", draft_model="random", max_draft_len=a.draft_len)) \
        if a.spec else {}
    if a.tree:
        k, d, n = tree_shape(a.tree)
        kw["speculative_config"].update(topk=k, max_draft_len=d, max_total_draft_tokens=n)
        if a.chains:  # without step costs (CPU) the fixed rule decides: more rows than this draft chains of D
            if n == d:
                ap.error("--chains: a tree of as many nodes as its depth is a chain already")
            kw["speculative_config"].update(tree_max_batch_size=0)
    llm = LLM(a.model, device="cpu", dtype="float32", num_kv_blocks=64, **kw)
    eng = llm.engine
    # the graph layout a CUDA engine replays (run eagerly here): its inputs are expanded from the step's record
    # on the device, which the count includes (phase "prepare")
    eng.runner.graphs = CudaGraphs(1, eng.runner._staging_buffers(), capture=False)
    eng.add_request(list(range(10, 10 + a.context)), SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    for _ in range(3):  # prefill, then generation steps
        eng.step()
    counter = Counter()
    launch = interpreter.InterpretedFunction.run

    def counted_launch(self, *args, **kwargs):
        counter.counts[(counter.phase, "triton:" + self.fn.__name__)] += 1
        with _disable_current_modes():  # the interpreter's own tensor work is not a device op
            return launch(self, *args, **kwargs)

    interpreter.InterpretedFunction.run = counted_launch
    runner = eng.runner
    wrap_phase(counter, runner.model, "forward", "target", "accept or sample")
    if a.tree and not a.chains:  # head step 0 over the accepted chain and the expansion (acceptance, KV move before)
        wrap_phase(counter, runner.speculator, "draft", "draft", "after")
    elif a.spec:  # the chain engine's draft loop, which a tree engine's chain step runs too (``_chain_step``)
        wrap_phase(counter, runner.speculator.drafter.head, "propose", "draft", "after")
    with counter, torch.inference_mode():
        eng.step()
    phases = collections.Counter()
    for (phase, _), n in counter.counts.items():
        phases[phase] += n
    kind = f"tree {a.tree}" + (", chains of D" if a.chains else "") if a.tree else "speculative" if a.spec else "plain"
    print(f"{kind} step: {sum(phases.values())} ops, by phase {dict(phases)}")
    for phase in phases:
        ops = sorted(((n, op) for (p, op), n in counter.counts.items() if p == phase), reverse=True)
        print(f"  {phase}: " + ", ".join(f"{op} x{n}" for n, op in ops))


if __name__ == "__main__":
    main()
