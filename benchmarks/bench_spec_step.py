"""Cost of one speculative engine step against one plain decode step, and of the head's draft loop.

For each batch size and draft length D, B requests with a fixed context are brought into the generation
phase, warmed up, and then ``--steps`` engine steps are timed one by one (the step ends with its one
device -> host copy, so wall time is the step's time). Inside each step the target forward (verify) and
the head's draft loop are timed by wrapping them (synchronising around each on CUDA). A random EAGLE-3
head with the target's shapes is used: the cost does not depend on its weights, and every step verifies
all D drafts whether or not they are accepted.

    python benchmarks/bench_spec_step.py --batch 1 16 --draft-len 1 2 3 4 5 6 [--model FILE] [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from specserve import LLM, SamplingParams
from specserve.loaders import load_config
from specserve.speculative.checkpoint import save_eagle3_head
from specserve.speculative.random_heads import random_head


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


class Timed:
    """Wraps a callable; records wall time per call (synchronised on CUDA)."""

    def __init__(self, fn, device):
        self.fn, self.device, self.times = fn, device, []

    def __call__(self, *a, **k):
        _sync(self.device)
        t0 = time.perf_counter()
        out = self.fn(*a, **k)
        _sync(self.device)
        self.times.append(time.perf_counter() - t0)
        return out


def run(llm: LLM, batch: int, context: int, warmup: int, steps: int, device: str) -> dict:
    eng = llm.engine
    g = torch.Generator().manual_seed(batch)
    vocab = eng.model_config.vocab_size
    sp = SamplingParams(temperature=0, max_tokens=(warmup + steps + 4) * 8, ignore_eos=True)
    rids = [eng.add_request(torch.randint(10, vocab, (context,), generator=g).tolist(), sp) for _ in range(batch)]
    reqs = [eng.requests[r] for r in rids]
    while any(r.num_output_tokens == 0 for r in reqs):
        eng.step()
    runner = eng.runner
    fwd = Timed(runner.model.forward, device)
    runner.model.forward = fwd
    head = getattr(runner, "head", None)
    draft = Timed(head.propose, device) if head is not None else None
    if head is not None:
        head.propose = draft
    step_times = []
    for i in range(warmup + steps):
        _sync(device)
        t0 = time.perf_counter()
        eng.step()
        step_times.append(time.perf_counter() - t0)
    for rid in rids:
        eng.abort_request(rid)
    del runner.model.forward
    if head is not None:
        del head.propose
    med = lambda xs: statistics.median(xs[warmup:]) * 1e3  # noqa: E731
    return dict(step_ms=med(step_times), target_ms=med(fwd.times),
                draft_ms=med(draft.times) if draft is not None else 0.0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    p.add_argument("--draft-len", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6])
    p.add_argument("--context", type=int, default=128, help="prompt tokens per request")
    p.add_argument("--draft-vocab", type=int, default=16384)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--kv-bytes", type=int, default=1 << 30)
    p.add_argument("--json", default=None)
    a = p.parse_args()

    cfg = load_config(a.model)
    tmp = Path(tempfile.mkdtemp())
    save_eagle3_head(random_head(cfg, "eagle3", a.draft_vocab), tmp / "head")
    common = dict(device=a.device, dtype=a.dtype, kv_cache_memory_bytes=a.kv_bytes)
    rows = []
    plain = LLM(a.model, **common)
    for b in a.batch:
        rows.append(dict(mode="decode", D=0, batch=b, **run(plain, b, a.context, a.warmup, a.steps, a.device)))
    del plain
    for d in a.draft_len:
        llm = LLM(a.model, speculative_config=dict(method="eagle3", draft_model=str(tmp / "head"), max_draft_len=d),
                  **common)
        for b in a.batch:
            rows.append(dict(mode="spec", D=d, batch=b, **run(llm, b, a.context, a.warmup, a.steps, a.device)))
        del llm
    dev = torch.cuda.get_device_name() if a.device.startswith("cuda") else "cpu"
    meta = dict(date=time.strftime("%Y-%m-%d"), device=dev, torch=torch.__version__, context=a.context,
                draft_vocab=a.draft_vocab, steps=a.steps, dtype=a.dtype)
    print(json.dumps(meta))
    base = {r["batch"]: r["step_ms"] for r in rows if r["mode"] == "decode"}
    print(f"{'mode':<8}{'D':>3}{'batch':>6}{'step ms':>9}{'x decode':>9}{'target ms':>10}{'draft ms':>9}")
    for r in rows:
        print(f"{r['mode']:<8}{r['D']:>3}{r['batch']:>6}{r['step_ms']:>9.2f}{r['step_ms'] / base[r['batch']]:>9.2f}"
              f"{r['target_ms']:>10.2f}{r['draft_ms']:>9.2f}")
    if a.json:
        Path(a.json).write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))


if __name__ == "__main__":
    main()
