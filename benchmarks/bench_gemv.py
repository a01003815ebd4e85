"""The few-row linear kernels (``specserve.kernels.gemv``) against cuBLAS + the separate norm / activation
kernels, inside CUDA graphs, with the default model's shapes (random bf16 weights, 30 layers' worth).

Two measurements at 1 and 5 tokens per step:
* per call: each projection (qkv with add+norm, o, gate/up with add+norm, down with SiLU-and-mul) timed as
  30 calls over 30 different weights in one graph, for the default split and a few others (features per
  program, warps), next to cuBLAS alone and cuBLAS plus its norm / activation kernel;
* a layer chain: the projections and norms of 30 decoder layers (no attention) as the engine runs them
  (norm, qkv, o, norm, gate/up, SiLU-and-mul, down) against the fused chain (qkv, o, gate/up, down).

    python benchmarks/bench_gemv.py [--json FILE]     (CUDA)
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from specserve.bench.steps import graph_us
from specserve.kernels.activation import silu_and_mul
from specserve.kernels.gemv import ADD_NORM, NONE, SILU_MUL, block_n, fused_linear, linear_ref
from specserve.kernels.norm import rms_norm

H, I, QKV, LAYERS, EPS = 576, 1536, 960, 30, 1e-5


def weights(seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def w(n, k):
        return (torch.randn(n, k, device="cuda", generator=g) * 0.02).to(torch.bfloat16)

    return [dict(qkv=w(QKV, H), o=w(H, H), gu=w(2 * I, H), down=w(H, I),
                 n1=1 + 0.1 * torch.randn(H, device="cuda", generator=g).to(torch.bfloat16),
                 n2=1 + 0.1 * torch.randn(H, device="cuda", generator=g).to(torch.bfloat16)) for _ in range(LAYERS)]


def check(ws, t: int) -> dict:
    """Largest relative error of each fused projection against its reference (bf16)."""
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(t, H, device="cuda", generator=g).to(torch.bfloat16)
    res = torch.randn(t, H, device="cuda", generator=g).to(torch.bfloat16)
    gu = torch.randn(t, 2 * I, device="cuda", generator=g).to(torch.bfloat16)
    w = ws[0]
    errs = {}
    for name, args in (("qkv+norm", (x, w["qkv"], None, ADD_NORM, res, w["n1"], EPS)), ("o", (x, w["o"])),
                       ("down+silu", (gu, w["down"], None, SILU_MUL))):
        out, r = fused_linear(*args)
        ref, rr = linear_ref(*args)
        errs[name] = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
        if rr is not None:
            errs[name + " residual"] = (r.float() - rr.float()).abs().max().item()
    return errs


def per_call(ws, t: int) -> list[dict]:
    g = torch.Generator(device="cuda").manual_seed(2)
    x = torch.randn(t, H, device="cuda", generator=g).to(torch.bfloat16)
    res = torch.randn(t, H, device="cuda", generator=g).to(torch.bfloat16)
    gu = torch.randn(t, 2 * I, device="cuda", generator=g).to(torch.bfloat16)
    rows = []
    cases = {  # name: (weight key, input, prologue, cuBLAS + separate kernel)
        "qkv (add+norm)": ("qkv", x, ADD_NORM, lambda w: F.linear(rms_norm(x, w["n1"], EPS, res)[0], w["qkv"])),
        "o": ("o", x, NONE, None),
        "gate/up (add+norm)": ("gu", x, ADD_NORM, lambda w: F.linear(rms_norm(x, w["n2"], EPS, res)[0], w["gu"])),
        "down (silu-mul)": ("down", gu, SILU_MUL, lambda w: F.linear(silu_and_mul(gu), w["down"])),
    }
    for name, (key, inp, pro, unfused) in cases.items():
        n, k = ws[0][key].shape
        nw = "n1" if key == "qkv" else "n2"
        lin_in = inp if pro != SILU_MUL else silu_and_mul(gu)
        row = dict(op=name, tokens=t, n=n, k=k,
                   cublas_us=graph_us(lambda: [F.linear(lin_in, w[key]) for w in ws], LAYERS),
                   default_block=block_n(n, k, t))
        if unfused is not None:
            row["cublas_plus_prologue_us"] = graph_us(lambda: [unfused(w) for w in ws], LAYERS)
        variants = {}
        d = row["default_block"]
        for bn, warps in ((d, 2), (d, 4), (d, 8), (max(1, d // 2), 4), (2 * d, 4), (2 * d, 8)):
            def fn(bn=bn, warps=warps):
                return [fused_linear(inp, w[key], None, pro, res if pro == ADD_NORM else None,
                                     w[nw] if pro == ADD_NORM else None, EPS, block=bn, num_warps=warps)
                        for w in ws]
            variants[f"bn{bn}/w{warps}"] = round(graph_us(fn, LAYERS), 2)
        row["fused_us"] = variants
        row["fused_default_us"] = variants.get(f"bn{row['default_block']}/w4")
        best = min(variants, key=variants.get)
        row["fused_best"] = (best, variants[best])
        rows.append(row)
        print(f"{name:20s} t={t} cuBLAS {row['cublas_us']:.2f} µs"
              + (f", + prologue kernel {row['cublas_plus_prologue_us']:.2f}" if unfused else "")
              + f"; fused default {row['fused_default_us']} (bn{row['default_block']}/w4), best {best} "
              f"{variants[best]:.2f}", flush=True)
    return rows


def chains(ws, t: int) -> dict:
    g = torch.Generator(device="cuda").manual_seed(3)
    x0 = torch.randn(t, H, device="cuda", generator=g).to(torch.bfloat16)

    def unfused():
        x, res = x0, torch.zeros_like(x0)
        for w in ws:
            h, res = rms_norm(x, w["n1"], EPS, res)
            qkv = F.linear(h, w["qkv"])
            o = F.linear(qkv[:, :H], w["o"])
            h, res = rms_norm(o, w["n2"], EPS, res)
            x = F.linear(silu_and_mul(F.linear(h, w["gu"])), w["down"])
        return x

    def fused():
        x, res = x0, torch.zeros_like(x0)
        for w in ws:
            qkv, res = fused_linear(x, w["qkv"], None, ADD_NORM, res, w["n1"], EPS)
            o, _ = fused_linear(qkv[:, :H], w["o"])
            gu, res = fused_linear(o, w["gu"], None, ADD_NORM, res, w["n2"], EPS)
            x, _ = fused_linear(gu, w["down"], None, SILU_MUL)
        return x

    a, b = unfused(), fused()
    err = ((a.float() - b.float()).norm() / a.float().norm()).item()
    out = dict(tokens=t, unfused_us=graph_us(unfused, 1), fused_us=graph_us(fused, 1), rel_err=err)
    print(f"chain of {LAYERS} layers t={t}: unfused (7 kernels/layer) {out['unfused_us']:.1f} µs, fused (4) "
          f"{out['fused_us']:.1f} µs, relative difference {err:.2e}", flush=True)
    return out


@torch.inference_mode()  # as the engine runs (the kernels step aside while autograd records)
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    ws = weights()
    result = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, checks={}, per_call=[], chains=[])
    for t in (1, 5):
        result["checks"][t] = check(ws, t)
        print(f"t={t} errors vs reference: {result['checks'][t]}", flush=True)
        result["chains"].append(chains(ws, t))
    for t in (1, 5):
        result["per_call"] += per_call(ws, t)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
