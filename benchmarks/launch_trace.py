"""Every Triton launch (kernel, grid, arguments: tensor shapes, strides and dtypes, other values and constexprs)
and the ATen op counts of each engine step, in Triton's interpreter, at the default model's widths (2 layers, a
random tiny tokenizer), plain or with a random EAGLE-3 head, through the padded graph layouts (uncaptured) and
packed steps. Two trees traced on the same model folder and compared tell, without a GPU, whether a change
alters the work a step launches.

    PYTHONPATH=TREE:TREE/tests python benchmarks/launch_trace.py MODEL_DIR plain|spec OUT.json   (NPROMPTS=1|2)
    python benchmarks/launch_trace.py --compare OLD.json NEW.json
"""
import collections
import json
import os
import sys


def compare(old_path: str, new_path: str) -> None:
    """Per step: launches that differ, and how (keywords only one side has, anything else); ATen count changes."""
    old, new = json.load(open(old_path)), json.load(open(new_path))
    print(f"steps: {len(old)} vs {len(new)}")
    for i, (x, y) in enumerate(zip(old, new)):
        la, lb = x["launches"], y["launches"]
        keywords, other = collections.Counter(), 0
        for p, q in zip(la, lb):
            if p == q:
                continue
            gone = sorted(k for k in p[3] if k not in q[3])
            added = sorted(k for k in q[3] if k not in p[3])
            same_rest = (p[0], p[1]) == (q[0], q[1]) and all(p[3][k] == q[3][k] for k in p[3] if k in q[3])
            same_tensors = [a for a in p[2] if isinstance(a, list)] == [a for a in q[2] if isinstance(a, list)]
            if same_rest and (p[2] == q[2] or same_tensors):
                keywords[(p[0], tuple(gone), tuple(added), p[2] == q[2])] += 1
            else:
                other += 1
        ops = {k: (x["ops"].get(k, 0), y["ops"].get(k, 0)) for k in set(x["ops"]) | set(y["ops"])
               if x["ops"].get(k, 0) != y["ops"].get(k, 0)}
        print(f"step {i}: {len(la)} vs {len(lb)} launches, {other} differing in kernel, grid, tensors or values;"
              f" keyword-only or non-tensor-argument changes {dict(keywords)}; ATen counts changed {ops}")


if len(sys.argv) == 4 and sys.argv[1] == "--compare":
    compare(sys.argv[2], sys.argv[3])
    sys.exit(0)
os.environ["TRITON_INTERPRET"] = "1"  # before Triton is imported
import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode
import triton.runtime.interpreter as I
from pathlib import Path

root = Path(sys.argv[1]); spec_on = sys.argv[2] == "spec"; out_path = sys.argv[3]
from tiny_models import make_hf_model, make_head
if not (root / "target" / "config.json").exists():
    make_hf_model(root / "target", "llama", initializer_range=0.4, num_hidden_layers=2, hidden_size=576,
                  intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3)
    make_head(root / "eagle3", root / "target", "eagle3", own_head=False, seed=1)
from specserve import LLM, SamplingParams
from specserve.runner.cuda_graph import CudaGraphs

launches = []
def desc(v):
    if isinstance(v, torch.Tensor):
        return ["T", list(v.shape), str(v.dtype), list(v.stride())]
    if isinstance(v, (int, float, bool, str)) or v is None:
        return v
    return type(v).__name__
run = I.InterpretedFunction.run
def rec(self, *args, grid, warmup, **kwargs):
    if not warmup:
        g = grid if isinstance(grid, tuple) else "fn"
        launches.append([self.fn.__name__, list(g) if isinstance(g, tuple) else g, [desc(a) for a in args],
                         {k: desc(v) for k, v in sorted(kwargs.items())}])
    return run(self, *args, grid=grid, warmup=warmup, **kwargs)
I.InterpretedFunction.run = rec

class Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__(); self.counts = collections.Counter()
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))

kw = dict(device="cpu", dtype="float32", max_num_seqs=4, num_kv_blocks=256)
if spec_on:
    kw["speculative_config"] = dict(method="eagle3", draft_model=str(root / "eagle3"), max_draft_len=4)
llm = LLM(str(root / "target"), **kw)
runner = llm.engine.runner
runner.graphs = CudaGraphs(4, runner._staging_buffers(), capture=False)
eng = llm.engine
sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
for p in ([5, 6, 7, 8, 9, 10, 11], [12, 13, 14])[:int(os.environ.get("NPROMPTS", "2"))]:
    eng.add_request(p, sp)
steps = []
while eng.has_unfinished_requests():
    launches.clear()
    ops = Ops()
    with ops:
        eng.step()
    steps.append(dict(launches=list(launches), ops=dict(sorted(ops.counts.items()))))
json.dump(steps, open(out_path, "w"))
print(len(steps), "steps", sum(len(s["launches"]) for s in steps), "launches")
