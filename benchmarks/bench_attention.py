"""Paged attention for decode (1 query per row) and verify (1 + 4) steps: the Triton kernel against PyTorch
SDPA (dense gather + mask, the reference) and FlexAttention (dense gather + block mask, compiled), on random
KV caches with the shapes of SmolLM2-135M and Llama-3.1-8B. One attention call (one layer), masks built
beforehand (the engine builds them once per step for all layers); median of triton.testing.do_bench.

    python benchmarks/bench_attention.py [--flex-configs 4] [--json FILE]     (CUDA)
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from triton.testing import do_bench

from specserve.kernels.attention import (build_mask, flex_block_mask, paged_attention_flex, paged_attention_sdpa,
                                         paged_attention_triton)

SHAPES = {"smollm2-135m": (9, 3, 64), "llama-3.1-8b": (32, 8, 128)}


def case(shape: str, batch: int, q: int, context: int, block: int = 16):
    hq, hkv, d = SHAPES[shape]
    m = -(-(context + 8) // block)
    n_blocks = batch * m + 1
    g = torch.Generator(device="cuda").manual_seed(0)
    kc = torch.randn(n_blocks, block, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g)
    vc = torch.randn_like(kc)
    tables = (torch.randperm(n_blocks - 1, device="cuda", generator=g) + 1)[:batch * m].view(batch, m)
    t = batch * q
    qidx = torch.arange(t, device="cuda").view(batch, q)
    qpos = (context - q + torch.arange(q, device="cuda")).expand(batch, q).contiguous()
    x = torch.randn(t, hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
    return x, kc, vc, tables, qidx, qpos, d ** -0.5


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--flex-configs", type=int, default=4, help="how many configurations also time Flex (compiles)")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    rows = []
    flex_left = a.flex_configs
    for shape in SHAPES:
        for batch in (1, 32):
            for q in (1, 5):
                for context in (512, 2048):
                    args = case(shape, batch, q, context)
                    mask = build_mask(args[5], args[3].shape[1] * 16, None)
                    ref = paged_attention_sdpa(*args, mask=mask)
                    tri = paged_attention_triton(*args)
                    err = ((tri.float() - ref.float()).norm() / ref.float().norm()).item()
                    row = dict(shape=shape, batch=batch, q=q, context=context, rel_err_triton=err,
                               triton_us=do_bench(lambda: paged_attention_triton(*args), return_mode="median") * 1e3,
                               sdpa_us=do_bench(lambda: paged_attention_sdpa(*args, mask=mask),
                                                return_mode="median") * 1e3)
                    if flex_left > 0 and (q == 5 or batch == 32):
                        flex_left -= 1
                        t0 = time.perf_counter()
                        bm = flex_block_mask(args[5], args[3].shape[1] * 16, None)
                        fo = paged_attention_flex(*args, block_mask=bm)
                        row["flex_compile_s"] = time.perf_counter() - t0
                        row["rel_err_flex"] = ((fo.float() - ref.float()).norm() / ref.float().norm()).item()
                        row["flex_us"] = do_bench(lambda: paged_attention_flex(*args, block_mask=bm),
                                                  return_mode="median") * 1e3
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    print(f"\n{'shape':<14}{'B':>4}{'Q':>3}{'ctx':>6}{'triton us':>11}{'sdpa us':>9}{'flex us':>9}{'err':>9}")
    for r in rows:
        flex = f"{r['flex_us']:.1f}" if "flex_us" in r else "-"
        print(f"{r['shape']:<14}{r['batch']:>4}{r['q']:>3}{r['context']:>6}{r['triton_us']:>11.1f}"
              f"{r['sdpa_us']:>9.1f}{flex:>9}{r['rel_err_triton']:>9.1e}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                           date=time.strftime("%Y-%m-%d %H:%M"), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
