"""Several-row projections: each weight block read once for all rows (``specserve.kernels.gemv_rows``, every
form and a sweep of launches) against one program per row (``gemv.fused_linear``, as a verify step runs them
now) and cuBLAS, inside CUDA graphs, with the default model's shapes (random bf16 weights, 30 layers' worth,
so that the weights do not stay in L2 between calls).

    python benchmarks/bench_rows.py [--json FILE] [--qkv-only]     (CUDA)

Also the qkv projection with its add + norm prologue, RoPE and the cache write (``qkv_rope``): one program per
row against the several-row kernel. Per projection and row count: the median replay per call (30 calls over 30
weights in one graph), µs, and each variant's largest error against ``F.linear`` (qkv: against the one-row
kernel) relative to the output's largest magnitude.
"""

from __future__ import annotations

import argparse
import json
import os
from unittest import mock

import torch
import torch.nn.functional as F

from specserve.bench.steps import graph_us
from specserve.kernels.gemv import ADD_NORM, block_n, fused_linear
from specserve.kernels.gemv_rows import rows_linear, rows_projection
from specserve.kernels.qkv_rope import _qkv_rows, qkv_rope_cache

H, I, LAYERS, EPS = 576, 1536, 30, 1e-5
SHAPES = {"gate/up": (2 * I, H), "qkv": (960, H), "o": (H, H), "down": (H, I)}
SWEEP = {"turn": [(bn, w) for bn in (4, 8, 16, 32) for w in (2, 4, 8)],
         "dot": [(bn, w) for bn in (16, 32, 64) for w in (1, 2, 4)],
         "bcast": [(bn, w) for bn in (2, 4, 8) for w in (4, 8)]}


def rel_err(out, ref) -> float:
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def timer(row: dict, ws: list, ref: torch.Tensor):
    """``time(label, fn, check=None)``: fn over every layer's weight in one graph, its median per call in
    row["us"]; check(ws[0])'s error against ``ref`` in row["err"]; a launch that does not build is noted there
    and the sweep goes on."""
    def time(label, fn, check=None):
        try:
            if check is not None:
                row["err"][label] = rel_err(check(ws[0]), ref)
            row["us"][label] = round(graph_us(lambda: [fn(w) for w in ws], LAYERS), 2)
        except Exception as e:
            row["us"][label] = None
            row["err"][label] = f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
    return time


def report(name: str, row: dict) -> dict:
    """Print a row's timings, fastest first, and any error past 2% or failure."""
    ok = sorted(((lab, us) for lab, us in row["us"].items() if us is not None), key=lambda kv: kv[1])
    print(f"{name} t={row['tokens']}: " + ", ".join(f"{lab} {us}" for lab, us in ok) + f"  | best {ok[0][0]}",
          flush=True)
    bad = {lab: e for lab, e in row["err"].items() if isinstance(e, str) or e > 2e-2}
    if bad:
        print(f"  errors / failures: {bad}", flush=True)
    return row


def measure(name: str, t: int, variants: dict, g) -> dict:
    n, k = SHAPES[name]
    ws = [(torch.randn(n, k, device="cuda", generator=g) * 0.02).to(torch.bfloat16) for _ in range(LAYERS)]
    x = torch.randn(t, k, device="cuda", generator=g).to(torch.bfloat16)
    res = torch.randn(t, k, device="cuda", generator=g).to(torch.bfloat16)
    nw = (1 + 0.1 * torch.randn(k, device="cuda", generator=g)).to(torch.bfloat16)
    ref = F.linear(x, ws[0])
    row = dict(op=name, tokens=t, n=n, k=k, us={}, err={})
    time = timer(row, ws, ref)

    time("cublas", lambda w: F.linear(x, w))
    time(f"per-row bn{block_n(n, k, t)}", lambda w: fused_linear(x, w)[0], lambda w: fused_linear(x, w)[0])
    if name == "gate/up":  # as a verify step runs it now: the norm in the prologue
        time("per-row add+norm", lambda w: fused_linear(x, w, None, ADD_NORM, res, nw, EPS)[0])
    for form, launches in variants.items():
        for bn, warps in launches:
            def fn(w, form=form, bn=bn, warps=warps):
                return rows_linear(x, w, form, bn, warps)
            time(f"{form} bn{bn}/w{warps}", fn, fn)
    if name == "gate/up":  # the dot form with the add + norm in its prologue (SPECSERVE_GEMV_ROWS_NORM=1)
        for bn, warps in variants.get("dot", []):
            def fn(w, bn=bn, warps=warps):
                return rows_projection(x, w, form="dot", block=bn, num_warps=warps, residual=res, norm_in=nw,
                                       eps=EPS)[0]
            time(f"dot+add+norm bn{bn}/w{warps}", fn)
    return report(name, row)


def measure_qkv(t: int, g) -> dict:
    """The qkv projection with its residual add + norm prologue, RoPE and the cache write: one program per row
    (``qkv_rope_cache``'s kernel with SPECSERVE_QKV_ROWS=0) against the several-row kernel in a sweep of
    launches (pairs per program / warps)."""
    hq, hkv, d, bs = 9, 3, 64, 16
    n, k = SHAPES["qkv"]
    ws = [(torch.randn(n, k, device="cuda", generator=g) * 0.02).to(torch.bfloat16) for _ in range(LAYERS)]
    x = torch.randn(t, k, device="cuda", generator=g).to(torch.bfloat16)
    res = torch.randn(t, k, device="cuda", generator=g).to(torch.bfloat16)
    nw = (1 + 0.1 * torch.randn(k, device="cuda", generator=g)).to(torch.bfloat16)
    freqs = torch.outer(torch.arange(4096, device="cuda").float(),
                        1.0 / (1e5 ** (torch.arange(0, d, 2, device="cuda").float() / d)))
    cos, sin = freqs.cos(), freqs.sin()
    kc, vc = torch.zeros(2, 64, bs, hkv, d, device="cuda", dtype=torch.bfloat16)
    pos = torch.arange(256, 256 + t, device="cuda")
    slots = pos.clone()
    common = (pos, cos, sin, kc, vc, slots, hq, hkv, d)
    row = dict(op="qkv+rope add+norm", tokens=t, n=n, k=k, us={}, err={})
    with mock.patch.dict(os.environ, {"SPECSERVE_QKV_ROWS": "0"}):
        ref = qkv_rope_cache(x, ws[0], None, ADD_NORM, res, nw, EPS, *common)[0]
        time = timer(row, ws, ref)
        time("per-row", lambda w: qkv_rope_cache(x, w, None, ADD_NORM, res, nw, EPS, *common))
    for hb, warps in ((16, 2), (16, 4), (16, 8), (32, 4), (32, 8)):
        def fn(w, hb=hb, warps=warps):
            return _qkv_rows(x, w, None, ADD_NORM, res, nw, EPS, *common, setting=(hb, warps))
        time(f"rows hb{hb}/w{warps}", fn, lambda w, fn=fn: fn(w)[0])
    return report("qkv+rope add+norm", row)


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--qkv-only", action="store_true", help="only the qkv + RoPE kernels")
    args = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = [measure_qkv(5, g), measure_qkv(8, g)]
    if args.qkv_only:
        return _write(args, rows)
    rows.append(measure("gate/up", 5, SWEEP, g))
    # each form's three best launches at 5 rows, on the other projections and row counts
    us = rows[-1]["us"]
    top = {form: sorted(((bn, w) for bn, w in launches if us.get(f"{form} bn{bn}/w{w}") is not None),
                        key=lambda bw: us[f"{form} bn{bw[0]}/w{bw[1]}"])[:3] for form, launches in SWEEP.items()}
    for name, t in (("gate/up", 2), ("gate/up", 8), ("qkv", 5), ("o", 5), ("down", 5)):
        rows.append(measure(name, t, top, g))
    _write(args, rows)


def _write(args, rows) -> None:
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
