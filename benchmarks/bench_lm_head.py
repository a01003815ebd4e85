"""A draft step's output layer on the H200: norm + the default model's lm_head (49,152 x 576, and its first
32,768 rows as a restricted draft vocabulary would read) for one row with the argmax inside (``fused_argmax``: the
projection writes each program's best logit, a second kernel picks), as int8 rows (``quantize_rows``), over a
sweep of launches, against the norm kernel + cuBLAS + argmax. Four calls per graph on the same weights, as a
draft loop of D = 4 makes them (an int8 table of 28 MB can stay in the 50 MB L2 between them). The sweep is of
the kernel drafts run: the norm's weight folded into the int8 rows and no norm prologue (``normed_argmax``); the
kernel with its prologue, as drafts ran before, at the default launch beside it. (The int8 rows were also timed
stored as uint8 q + 128, converted by integer and float adds instead of int-to-float
instructions: no faster on the H200.)

    python benchmarks/bench_lm_head.py [--json FILE]     (CUDA)
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from specserve.bench.steps import graph_us
from specserve.kernels.argmax import argmax_lastdim
from specserve.kernels.gemv import NONE, NORM, fused_argmax, quantize_rows
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
    default = f"bn{_LM_LAUNCH['block']}/w{_LM_LAUNCH['num_warps']}"
    res = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, default={"int8": default})
    res["cublas_plus_norm_us"] = graph_us(
        lambda: [argmax_lastdim(F.linear(rms_norm(x, nw, EPS), w)) for _ in range(CALLS)], CALLS)
    print(f"norm kernel + cuBLAS + argmax: {res['cublas_plus_norm_us']:.2f} µs per call", flush=True)
    q8, scale = quantize_rows(w)
    qf, scale_f = quantize_rows(w.float() * nw.float())  # the norm's weight folded in (what drafts now read)
    res["int8_norm_prologue_us"] = round(graph_us(
        lambda: [fused_argmax(x, q8, NORM, nw, EPS, scale=scale, **_LM_LAUNCH) for _ in range(CALLS)], CALLS), 2)
    print(f"int8 with the norm prologue, as before ({default}): {res['int8_norm_prologue_us']} µs", flush=True)
    for rows in (V, 32768):  # the whole vocabulary, and a draft vocabulary of 32,768 of its rows
        sweep = {}
        for bn in (16, 32, 64, 128):
            for warps in (2, 4, 8):
                def fn(rows=rows, bn=bn, warps=warps):
                    return [fused_argmax(x, qf[:rows], NONE, scale=scale_f[:rows], block=bn, num_warps=warps)
                            for _ in range(CALLS)]
                sweep[f"bn{bn}/w{warps}"] = round(graph_us(fn, CALLS), 2)
        best = min(sweep, key=sweep.get)
        key = "int8_folded" if rows == V else f"int8_folded-{rows}"
        res[key] = dict(sweep=sweep, best=best)
        print(f"{key}: default {default} {sweep.get(default)} µs, best {best} {sweep[best]} µs; all: {sweep}",
              flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
