"""Paged attention for decode (1 query per row) and verify (1 + 4) steps: the Triton kernel against PyTorch
SDPA (dense gather + mask, the reference) and FlexAttention (dense gather + block mask, compiled), on random
KV caches with the shapes of SmolLM2-135M and Llama-3.1-8B. One attention call (one layer), masks built
beforehand (the engine builds them once per step for all layers); each timed as 30 calls inside one CUDA
graph (a step's layers, as the engine replays them), per call; an implementation that cannot be captured is
timed eagerly (triton.testing.do_bench) and its row says so.

    python benchmarks/bench_attention.py [--flex-configs 8] [--json FILE]     (CUDA)

``--prefill``: the same for prompt chunks (positions from 0), beside PyTorch's SDPA over dense causal q, k, v.

``--cached``: the same for prompt chunks after a cached prefix (a question over a cached document, a later
chunk of a long prompt): the default launch against key splits, tile rows and keys per iteration.

``--tree``: a draft tree's verify step at batch 1 (a root and 24 or 12 nodes of random parents, the tree's mask), the
default launch against key splits, tile rows, keys per iteration and warps, beside a chain's 1 + 4 queries
(``--default-only``: the default launch and the chain alone).

``--sweep``: the Triton kernel's launch choices instead (key splits, keys per inner iteration, warps) for each
shape, query count and context, with block tables as wide as the engine's graph layouts make them (a power of
two of at least 256 positions), each timed as 30 calls inside one CUDA graph (a step's layers), per call.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time

import torch
from triton.testing import do_bench

from specserve.bench import steps
from specserve.kernels.attention import (build_mask, flex_block_mask, paged_attention_flex, paged_attention_sdpa,
                                         paged_attention_triton)
from specserve.speculative.tree import tree_layout

SHAPES = {"smollm2-135m": (9, 3, 64), "llama-3.1-8b": (32, 8, 128)}
# --prefill: (shape, rows, prompt tokens a row)
# --cached: (shape, rows, prompt tokens a row, cached tokens before them)
CACHED_CASES = (("smollm2-135m", 1, 64, 6144), ("smollm2-135m", 8, 64, 6144), ("smollm2-135m", 1, 512, 2048),
                ("llama-3.1-8b", 1, 64, 6144))
PREFILL_CASES = (("smollm2-135m", 1, 512), ("smollm2-135m", 1, 2048), ("smollm2-135m", 1, 8000),
                 ("smollm2-135m", 4, 512), ("llama-3.1-8b", 1, 2048))


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


def graph_us(fn, calls: int = 30) -> float:
    """Median time per call of ``fn`` captured ``calls`` times in one CUDA graph, in microseconds."""
    return steps.graph_us(lambda: [fn() for _ in range(calls)], calls)


def timed(fn) -> tuple[float, str]:
    """Microseconds per call of ``fn``: in a CUDA graph, or eagerly where capture fails."""
    try:
        return graph_us(fn), "graph"
    except Exception:  # e.g. a host sync inside fn
        torch.cuda.synchronize()
        return do_bench(fn, return_mode="median") * 1e3, "eager"


def checked_us(fn, ref: torch.Tensor, label: str) -> float:
    """``fn``'s time per call (``graph_us``) once its output matches ``ref`` (relative error at most 2%)."""
    out = fn()
    err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    if err > 2e-2:
        raise AssertionError(f"{label}: relative error {err}")
    return graph_us(fn)


def keep_best(res: dict, variants: dict[str, float], rows: list) -> str:
    """Record the variants and the best of them in ``res``, append it to ``rows`` -> the four fastest, printable."""
    best = min(variants, key=variants.get)
    res.update(best=best, best_us=variants[best], variants=variants)
    rows.append(res)
    return "  ".join(f"{k} {variants[k]:.2f}" for k in sorted(variants, key=variants.get)[:4])


def launch_variants(args: tuple, ref: torch.Tensor, what: str, splits: tuple, block_ms: tuple, block_ns: tuple,
                    keys: int | None = None, **kw) -> dict[str, float]:
    """``paged_attention_triton(*args, **kw)``'s time per call (``checked_us`` against ``ref``) for each key split
    count, tile rows, keys per iteration and 4 or 8 warps, by label; a launch that fails (out of shared memory
    for a wide tile) is skipped, as is one whose splits of that many keys would pass ``keys`` table positions."""
    out = {}
    for s, m, b, w in itertools.product(splits, block_ms, block_ns, (4, 8)):
        if keys is not None and b * s > keys:
            continue

        def fn(s=s, m=m, b=b, w=w):
            return paged_attention_triton(*args, num_splits=s, block_m=m, block_n=b, num_warps=w, **kw)
        label = f"s{s}-m{m}-n{b}-w{w}"
        try:
            fn()
        except Exception as e:  # e.g. out of shared memory for a wide tile
            print(f"  skip {label}: {type(e).__name__}", flush=True)
            continue
        out[label] = checked_us(fn, ref, f"{what} {label}")
    return out


def dump(json_path: str | None, rows: list) -> None:
    if json_path:
        with open(json_path, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                           date=time.strftime("%Y-%m-%d %H:%M"), rows=rows), f, indent=1)


def sweep(json_path: str | None) -> None:
    rows = []
    cases = [("smollm2-135m", q, c) for q in (1, 5) for c in (200, 400, 1000)] + \
            [("llama-3.1-8b", q, 400) for q in (1, 5)]
    for shape, q, context in cases:
        need = -(-(context + 8) // 16)
        width = max(16, 1 << (need - 1).bit_length())  # the engine's graph table width (blocks)
        x, kc, vc, tables, qidx, qpos, scale = case(shape, 1, q, width * 16 - 8)
        qpos = qpos - (width * 16 - 8 - context)  # positions end at `context`: the table is wider than needed
        ref = paged_attention_sdpa(x, kc, vc, tables, qidx, qpos, scale)
        d = SHAPES[shape][2]
        # default_us: the kernel's default launch for a caller that does not merge the splits itself (up to
        # ONE_SPLIT_KEYS positions one split; the engine's o projection merges them, and such tables split)
        res = dict(shape=shape, q=q, context=context, keys=width * 16,
                   default_us=graph_us(lambda: paged_attention_triton(x, kc, vc, tables, qidx, qpos, scale)))
        variants = {}
        for splits in (1, 2, 4):
            for bn in (32, 64, 128, 256):
                if bn * splits > width * 16 or (d > 64 and bn > 128):
                    continue
                for warps in (4, 8):
                    def fn(s=splits, b=bn, w=warps):
                        return paged_attention_triton(x, kc, vc, tables, qidx, qpos, scale, num_splits=s,
                                                      block_n=b, num_warps=w)
                    variants[f"s{splits}-n{bn}-w{warps}"] = checked_us(
                        fn, ref, f"{shape} q={q} ctx={context} splits={splits} bn={bn} w={warps}")
        top = keep_best(res, variants, rows)
        print(f"{shape:<13} q={q} ctx={context:>5} keys={width * 16:>5}  default {res['default_us']:6.2f} us  best "
              + top, flush=True)
    dump(json_path, rows)


def prefill_sweep(json_path: str | None) -> None:
    """Prompt chunks (queries at positions 0 .. q-1 of each row): the Triton kernel's launch choices, and PyTorch's
    SDPA over dense causal q, k, v (its flash kernel on CUDA) as the mark of what a prompt pass can take."""
    import torch.nn.functional as F

    rows = []
    for shape, batch, q in PREFILL_CASES:
        hq, hkv, d = SHAPES[shape]
        need = -(-q // 16)
        width = max(16, 1 << (need - 1).bit_length())  # the engine's graph table width (blocks)
        x, kc, vc, tables, qidx, qpos, scale = case(shape, batch, q, width * 16 - 8)
        qpos = qpos - qpos[:, :1]  # a prompt from position 0
        ref = paged_attention_sdpa(x, kc, vc, tables, qidx, qpos, scale)
        res = dict(shape=shape, batch=batch, q=q, keys=width * 16,
                   default_us=graph_us(lambda: paged_attention_triton(x, kc, vc, tables, qidx, qpos, scale)))
        # dense causal SDPA over the same keys, gathered beforehand (not timed): [B, H, q, D]
        k = kc[tables].view(batch, -1, hkv, d)[:, :q].repeat_interleave(hq // hkv, 2).transpose(1, 2).contiguous()
        v = vc[tables].view(batch, -1, hkv, d)[:, :q].repeat_interleave(hq // hkv, 2).transpose(1, 2).contiguous()
        qd = x.view(batch, q, hq, d).transpose(1, 2).contiguous()
        res["sdpa_dense_us"] = graph_us(lambda: F.scaled_dot_product_attention(qd, k, v, is_causal=True, scale=scale))
        variants = launch_variants((x, kc, vc, tables, qidx, qpos, scale), ref, f"{shape} B={batch} q={q}",
                                   (1, 4, 8), (64, 128), (32, 64))
        top = keep_best(res, variants, rows)
        print(f"{shape:<13} B={batch} q={q:>5}  default {res['default_us']:7.2f} us  sdpa dense "
              f"{res['sdpa_dense_us']:7.2f}  best " + top, flush=True)
    dump(json_path, rows)


def cached_sweep(json_path: str | None) -> None:
    """Prompt chunks after a cached prefix (queries at positions prefix .. prefix + q - 1, tables as wide as the
    engine's graph layouts make them): the default launch and the best of the launch choices."""
    rows = []
    for shape, batch, q, prefix in CACHED_CASES:
        need = -(-(prefix + q) // 16)
        width = max(16, 1 << (need - 1).bit_length())  # the engine's graph table width (blocks)
        x, kc, vc, tables, qidx, qpos, scale = case(shape, batch, q, width * 16 - 8)
        qpos = qpos - qpos[:, :1] + prefix
        ref = paged_attention_sdpa(x, kc, vc, tables, qidx, qpos, scale)
        res = dict(shape=shape, batch=batch, q=q, prefix=prefix, keys=width * 16,
                   default_us=checked_us(lambda: paged_attention_triton(x, kc, vc, tables, qidx, qpos, scale), ref,
                                         f"{shape} B={batch} q={q} prefix={prefix} default"))
        variants = {}
        for splits in (4, 8, 16, 32):
            for bm in (32, 64):
                for bn in (32, 64):
                    def fn(s=splits, m=bm, b=bn):
                        return paged_attention_triton(x, kc, vc, tables, qidx, qpos, scale, num_splits=s, block_m=m,
                                                      block_n=b)
                    variants[f"s{splits}-m{bm}-n{bn}"] = checked_us(fn, ref, f"{shape} B={batch} q={q} s{splits}")
        top = keep_best(res, variants, rows)
        print(f"{shape:<13} B={batch} q={q:>4} prefix={prefix:>5}  default {res['default_us']:7.2f} us  best " + top,
              flush=True)
    dump(json_path, rows)


def tree_sweep(json_path: str | None, variants_too: bool = True) -> None:
    """A draft tree's verify attention at batch 1 (random parents, the engine's graph table widths): the default
    launch, the chain's 1 + 4 queries at the same context, and the launch choices, checked against SDPA with the
    tree's mask."""
    rows = []
    g = torch.Generator().manual_seed(0)
    for nodes in (24, 12):
        for context in (256, 1024):
            q = nodes + 1
            width = max(16, 1 << (-(-(context + 8) // 16) - 1).bit_length())  # the engine's graph table width
            x, kc, vc, tables, qidx, qpos, scale = case("smollm2-135m", 1, q, width * 16 - 8)
            qpos = qpos - (width * 16 - 8 - context)
            parents = [int(torch.randint(0, c, (1,), generator=g)) for c in range(1, q)]
            bits = tree_layout(parents)[1]  # the queries' positions stay their columns' (their keys' slots)
            tree = dict(tree_bits=torch.tensor([bits], device="cuda"), tree_base=qpos[:, 0].clone())
            ref = paged_attention_sdpa(x, kc, vc, tables, qidx, qpos, scale,
                                       mask=build_mask(qpos, tables.shape[1] * 16, None, **tree))
            chain = list(case("smollm2-135m", 1, 5, width * 16 - 8))
            chain[5] = chain[5] - (width * 16 - 8 - context)  # its queries end where the tree's do
            res = dict(nodes=nodes, context=context, keys=width * 16,
                       default_us=checked_us(lambda: paged_attention_triton(x, kc, vc, tables, qidx, qpos, scale,
                                                                            **tree), ref, f"tree {q} default"),
                       chain_us=graph_us(lambda: paged_attention_triton(*chain)))
            top = ""
            if variants_too:
                variants = launch_variants((x, kc, vc, tables, qidx, qpos, scale), ref, f"tree {q} ctx={context}",
                                           (1, 2, 4, 8), (16, 32, 64), (32, 64, 128), keys=width * 16, **tree)
                top = "  best " + keep_best(res, variants, rows)
            else:
                rows.append(res)
            print(f"tree of {nodes:>2} nodes ctx={context:>5} keys={width * 16:>5}  default {res['default_us']:6.2f} us"
                  f"  chain {res['chain_us']:6.2f}{top}", flush=True)
    dump(json_path, rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--flex-configs", type=int, default=8, help="how many configurations also time Flex (compiles)")
    p.add_argument("--json", default=None)
    p.add_argument("--sweep", action="store_true", help="time the Triton kernel's launch choices instead")
    p.add_argument("--prefill", action="store_true",
                   help="time the Triton kernel's launch choices for prompt chunks, beside dense causal SDPA")
    p.add_argument("--cached", action="store_true",
                   help="time the Triton kernel's launch choices for prompt chunks after a cached prefix")
    p.add_argument("--tree", action="store_true",
                   help="time the Triton kernel's launch choices for a draft tree's verify step")
    p.add_argument("--default-only", action="store_true", help="with --tree: the default launch and the chain only")
    a = p.parse_args()
    if a.tree:
        return tree_sweep(a.json, not a.default_only)
    if a.cached:
        return cached_sweep(a.json)
    if a.sweep:
        return sweep(a.json)
    if a.prefill:
        return prefill_sweep(a.json)
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
                    row = dict(shape=shape, batch=batch, q=q, context=context, rel_err_triton=err)
                    row["triton_us"], row["triton_timing"] = timed(lambda: paged_attention_triton(*args))
                    row["sdpa_us"], row["sdpa_timing"] = timed(lambda: paged_attention_sdpa(*args, mask=mask))
                    if flex_left > 0 and context == 512:
                        flex_left -= 1
                        t0 = time.perf_counter()
                        bm = flex_block_mask(args[5], args[3].shape[1] * 16, None)
                        fo = paged_attention_flex(*args, block_mask=bm)
                        row["flex_compile_s"] = time.perf_counter() - t0
                        row["rel_err_flex"] = ((fo.float() - ref.float()).norm() / ref.float().norm()).item()
                        row["flex_us"], row["flex_timing"] = timed(lambda: paged_attention_flex(*args, block_mask=bm))
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    print(f"\n{'shape':<14}{'B':>4}{'Q':>3}{'ctx':>6}{'triton us':>11}{'sdpa us':>11}{'flex us':>11}{'err':>9}")
    for r in rows:
        def cell(k):  # an eagerly timed figure is marked with *
            return "-" if f"{k}_us" not in r else f"{r[f'{k}_us']:.1f}" + ("*" if r[f"{k}_timing"] == "eager" else "")
        print(f"{r['shape']:<14}{r['batch']:>4}{r['q']:>3}{r['context']:>6}{cell('triton'):>11}"
              f"{cell('sdpa'):>11}{cell('flex'):>11}{r['rel_err_triton']:>9.1e}")
    print("(* timed eagerly: capture failed)")
    dump(a.json, rows)


if __name__ == "__main__":
    main()
