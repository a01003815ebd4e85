"""A draft step's output layer on the H200: norm + the default model's lm_head (49,152 x 576) for one row, as
the few-row kernel in bfloat16 and in int8 rows (``quantize_rows``) over a sweep of launches, against the norm
kernel + cuBLAS. Four calls per graph on the same weights, as a draft loop of D = 4 makes them (an int8 table
of 28 MB can stay in the 50 MB L2 between them, a bfloat16 one of 57 MB cannot).

    python benchmarks/bench_lm_head.py [--json FILE]     (CUDA)
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from specserve.bench.steps import graph_us
from specserve.kernels.gemv import NORM, block_n, fused_linear, quantize_rows
from specserve.kernels.norm import rms_norm
from specserve.models.layers import _LM_LAUNCH

V, H, CALLS, EPS = 49152, 576, 4, 1e-5


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    w = (torch.randn(V, H, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
    nw = (1 + 0.1 * torch.randn(H, device="cuda", generator=g)).to(torch.bfloat16)
    x = torch.randn(1, H, device="cuda", generator=g).to(torch.bfloat16)
    q, scale = quantize_rows(w)
    # the engine's launches: bfloat16 output layers take block_n's, int8 ones _LM_LAUNCH
    res = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
               default={"bf16": f"bn{block_n(V, H, 1)}/w4",
                        "int8": f"bn{_LM_LAUNCH['block']}/w{_LM_LAUNCH['num_warps']}"})
    res["cublas_plus_norm_us"] = graph_us(lambda: [F.linear(rms_norm(x, nw, EPS), w) for _ in range(CALLS)], CALLS)
    print(f"norm kernel + cuBLAS: {res['cublas_plus_norm_us']:.2f} µs per call", flush=True)
    for name, weight, sc in (("bf16", w, None), ("int8", q, scale)):
        sweep = {}
        for bn in (4, 8, 16, 32):
            for warps in (4, 8):
                def fn(bn=bn, warps=warps):
                    return [fused_linear(x, weight, None, NORM, norm_weight=nw, eps=EPS, block=bn, num_warps=warps,
                                         scale=sc) for _ in range(CALLS)]
                sweep[f"bn{bn}/w{warps}"] = round(graph_us(fn, CALLS), 2)
        best = min(sweep, key=sweep.get)
        res[name] = dict(sweep=sweep, best=best)
        d = res["default"][name]
        print(f"{name}: default {d} {sweep.get(d)} µs, best {best} {sweep[best]} µs; all: {sweep}", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
