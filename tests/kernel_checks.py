"""Each Triton kernel against its PyTorch reference on random inputs (run by tests/test_kernels.py on the GPU,
or on the CPU through Triton's interpreter: ``TRITON_INTERPRET=1 python tests/kernel_checks.py``)."""

from __future__ import annotations

import functools
import os
import sys

import torch

from specserve import kernels
from specserve.kernels import use_triton
from specserve.kernels.accept import greedy_accept, greedy_accept_ref
from specserve.kernels.argmax import CHUNK, argmax_lastdim
from specserve.kernels.activation import silu_and_mul, silu_and_mul_ref
from specserve.kernels.attention import paged_attention_flex, paged_attention_sdpa, paged_attention_triton
from specserve.kernels.norm import embed_norm_cat, rms_norm, rms_norm_ref
from specserve.kernels.rope import rope_and_cache, rope_ref, write_kv_ref
from specserve.kernels.draft_inputs import draft_inputs, draft_inputs_ref
from specserve.kernels import gemv
from specserve.kernels.gemv import ADD_NORM, NONE, NORM, SILU_MUL, fused_linear, gemv_enabled, linear_ref
from specserve.kernels.qkv_rope import EMBED_CAT, qkv_rope_cache
from specserve.kernels.step_inputs import expand_record, expand_record_ref
from specserve.runner.sampler import SamplingTensors
from specserve.spec import accept as spec_accept

TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}
# SPECSERVE_KERNEL_CHECKS=quick: the CPU suite's run through Triton's interpreter, which costs about a second per
# few kernel programs (the full checks take about 40 minutes on 2 cores). Every kernel and each of its branches
# still runs, on fewer heads, features and table positions; the GPU and a full interpreter run take every shape.
QUICK = os.environ.get("SPECSERVE_KERNEL_CHECKS") == "quick"


def kernel_check(fn):
    """Run a check without autograd (the kernels never run while autograd records) and make sure the
    Triton path is the one taken, so a check can never compare a reference with itself."""
    @functools.wraps(fn)
    def run(device, dtype):
        with torch.no_grad():
            assert use_triton(torch.empty(1, device=device)), "the Triton kernels are off for this device"
            fn(device, dtype)
            assert not kernels.FAILED, f"kernels fell back to their references: {sorted(kernels.FAILED)}"
    return run


def _close(a, b, dtype, what):
    a, b = a.float(), b.float()
    err = (a - b).abs().max().item() / max(1.0, b.abs().max().item())
    assert err <= TOL[dtype], f"{what}: max relative error {err:.2e} > {TOL[dtype]:.0e}"


@kernel_check
def check_norm(device, dtype):
    g = torch.Generator().manual_seed(0)
    for h in (64, 576, 1000):
        x = torch.randn(7, h, generator=g).to(device, dtype)
        r = torch.randn(7, h, generator=g).to(device, dtype)
        w = (1 + 0.1 * torch.randn(h, generator=g)).to(device, dtype)
        _close(rms_norm(x, w, 1e-5), rms_norm_ref(x, w, 1e-5), dtype, "rms_norm")
        out, res = rms_norm(x, w, 1e-5, r)
        ref_out, ref_res = rms_norm_ref(x, w, 1e-5, r)
        assert torch.equal(res, ref_res), "residual add"
        _close(out, ref_out, dtype, "rms_norm+residual")


@kernel_check
def check_silu(device, dtype):
    g = torch.Generator().manual_seed(1)
    for i in (64, 1536, 1500):
        x = torch.randn(5, 2 * i, generator=g).to(device, dtype)
        _close(silu_and_mul(x), silu_and_mul_ref(x), dtype, "silu_and_mul")


@kernel_check
def check_rope_cache(device, dtype):
    g = torch.Generator().manual_seed(2)
    t, hq, hkv, d, n, bs = 6, 9, 3, 64, 5, 16
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g).to(device, dtype)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    q, k, v = q.view(t, hq, d), k.view(t, hkv, d), v.view(t, hkv, d)
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    freqs = torch.outer(torch.arange(100).float(), inv)
    cos, sin = freqs.cos().to(device), freqs.sin().to(device)
    pos = torch.tensor([0, 5, 17, 40, 41, 99], device=device)
    slots = torch.tensor([16, 21, 33, 79, 64, 0], device=device)
    kc, vc = (torch.zeros(2, n, bs, hkv, d, dtype=dtype, device=device) for _ in range(2))
    qo = rope_and_cache(pos, q, k, v, cos, sin, kc[0], vc[0], slots)
    rq, rk = rope_ref(pos, q, k, cos, sin)
    write_kv_ref(kc[1], vc[1], rk, v, slots)
    _close(qo, rq, dtype, "rope q")
    _close(kc[0], kc[1], dtype, "rope k -> cache")
    assert torch.equal(vc[0], vc[1]), "v -> cache"


@kernel_check
def check_qkv_rope(device, dtype):
    """The qkv projection with RoPE and the cache write inside against the projection and then the rope kernel
    (q heads rotated, k rotated and v as is into the cache; their sums run in another order, so close, not
    equal), for each prologue (a draft head's: against ``embed_norm_cat``), with and without a bias, with the
    weights loaded first and after the prologue; a row of a 5-row step exactly as the same row in steps of 1
    and 2 rows (a verify row rounds as a decode row)."""
    g = torch.Generator().manual_seed(12)
    hq, hkv, d, blocks, bs, k = (3, 1, 32, 5, 16, 96) if QUICK else (9, 3, 64, 5, 16, 576)
    n = (hq + 2 * hkv) * d
    w = (0.05 * torch.randn(n, k, generator=g)).to(device, dtype)
    bias = torch.randn(n, generator=g).to(device, dtype)
    nw = (1 + 0.1 * torch.randn(k, generator=g)).to(device, dtype)
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    freqs = torch.outer(torch.arange(100).float(), inv)
    cos, sin = freqs.cos().to(device), freqs.sin().to(device)
    x = torch.randn(5, k, generator=g).to(device, dtype)
    res = torch.randn(5, k + 8, generator=g).to(device, dtype)[:, :k]
    w2 = (0.05 * torch.randn(n, 2 * k, generator=g)).to(device, dtype)  # EMBED_CAT's projection: [embedding, x]
    table = torch.randn(50, k, generator=g).to(device, dtype)
    nw_e = (1 + 0.1 * torch.randn(k, generator=g)).to(device, dtype)
    ids = torch.tensor([3, 49, 0, 7, 3], device=device)
    pos = torch.tensor([0, 5, 17, 40, 99], device=device)
    slots = torch.tensor([16, 21, 33, 79, 64], device=device)
    wfirst = gemv.WFIRST
    try:
        for first in (True, False):
            gemv.WFIRST = first
            for pro, b in ((NONE, None), (NORM, bias), (ADD_NORM, bias if first else None), (EMBED_CAT, None)):
                what = f"qkv+rope prologue={pro} bias={b is not None} weights first={first}"
                caches = [torch.zeros(2, blocks, bs, hkv, d, dtype=dtype, device=device) for _ in range(3)]

                def args(rows):
                    return (x[rows], w2 if pro == EMBED_CAT else w, b, pro, res[rows] if pro == ADD_NORM else None,
                            None if pro == NONE else nw, 1e-5)

                def embed(rows):  # a draft head's input: a token's embedding and a hidden state, each normed
                    return dict(embed=(ids[rows], table, nw_e)) if pro == EMBED_CAT else {}
                got = qkv_rope_cache(*args(slice(None)), pos, cos, sin, *caches[0], slots, hq, hkv, d,
                                     **embed(slice(None)))
                assert got is not None, "the check would compare the reference with itself"
                if pro == EMBED_CAT:
                    qkv, r = fused_linear(embed_norm_cat(ids, table, nw_e, x, nw, 1e-5), w2)
                else:
                    qkv, r = fused_linear(*args(slice(None)))
                q, kk, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
                ref_q = rope_and_cache(pos, q.view(5, hq, d), kk.view(5, hkv, d), v.view(5, hkv, d), cos, sin,
                                       *caches[1], slots)
                _close(got[0], ref_q, dtype, what + ": q")
                _close(caches[0], caches[1], dtype, what + ": cache")
                assert (got[1] is None) == (r is None) and (r is None or torch.equal(got[1], r)), what + ": residual"
                for rows in (slice(2, 3), slice(1, 3)):  # the same row in a step of 1 and of 2 rows
                    caches[2].zero_()
                    part = qkv_rope_cache(*args(rows), pos[rows], cos, sin, *caches[2], slots[rows], hq, hkv, d,
                                          **embed(rows))
                    assert torch.equal(part[0][-1], got[0][2]), what + f": row 2 in a step of {part[0].shape[0]}"
                    kc = caches[0].view(2, blocks * bs, hkv, d)[:, int(slots[2])]
                    assert torch.equal(caches[2].view(2, blocks * bs, hkv, d)[:, int(slots[2])], kc), \
                        what + f": its cache entries in a step of {part[0].shape[0]}"
    finally:
        gemv.WFIRST = wfirst


@kernel_check
def check_attention(device, dtype):
    g = torch.Generator().manual_seed(3)
    for hq, hkv, d in ((9, 3, 64), (4, 4, 32)) if QUICK else ((9, 3, 64), (32, 8, 128), (4, 4, 32)):
        n_blocks, bs = 64, 16
        kc = torch.randn(n_blocks, bs, hkv, d, generator=g).to(device, dtype)
        vc = torch.randn(n_blocks, bs, hkv, d, generator=g).to(device, dtype)
        # rows: a verify row (5 queries), a decode row, a long prefill chunk, a padded row, a row past one split
        lens = [(37, 5), (16, 1), (200, 24), (3, 2), (300, 5)] if QUICK else \
            [(37, 5), (16, 1), (300, 70), (3, 2), (610, 5)]
        m = 20 if QUICK else 40
        tables = torch.zeros(len(lens), m, dtype=torch.int64)
        qw = max(nq for _, nq in lens)
        qidx = torch.full((len(lens), qw), 0, dtype=torch.int64)
        qpos = torch.zeros(len(lens), qw, dtype=torch.int64)
        t = sum(nq for _, nq in lens)
        qidx.fill_(t)
        t0 = 0
        perm = torch.randperm(n_blocks - 1, generator=g) + 1
        used = 0
        for b, (ctx, nq) in enumerate(lens):
            nb = -(-ctx // bs)
            tables[b, :nb] = perm[used % (n_blocks - 1):used % (n_blocks - 1) + nb] if used % (n_blocks - 1) + nb < n_blocks else perm[:nb]
            used += nb
            qidx[b, :nq] = torch.arange(t0, t0 + nq)
            qpos[b, :nq] = torch.arange(ctx - nq, ctx)
            t0 += nq
        q = torch.randn(t, hq, d, generator=g).to(device, dtype)
        args = (q, kc, vc, tables.to(device), qidx.to(device), qpos.to(device), d ** -0.5)
        ref = paged_attention_sdpa(*args)
        # 640 (quick: 320) table positions: several splits with partial sums and the merge kernel; forced to one
        # split, the split kernel writes the output itself (the default up to ONE_SPLIT_KEYS positions)
        _close(paged_attention_triton(*args), ref, dtype, f"paged attention {hq}/{hkv}/{d}")
        _close(paged_attention_triton(*args, num_splits=1), ref, dtype, f"paged attention, 1 split {hq}/{hkv}/{d}")
        # FlexAttention, the third implementation (compiled on CUDA: bfloat16 only, to bound compile time)
        if dtype == (torch.bfloat16 if device == "cuda" else torch.float32):
            _close(paged_attention_flex(*args), ref, dtype, f"flex attention {hq}/{hkv}/{d}")
        for window, ns in ((8, 1), (100, None)) if QUICK else ((8, None), (8, 1), (100, None), (100, 1)):
            _close(paged_attention_triton(*args, sliding_window=window, num_splits=ns),
                   paged_attention_sdpa(*args, sliding_window=window), dtype, f"sliding window {window}, {ns}")


@kernel_check
def check_greedy_accept(device, dtype):
    """Exact: every prefix length, rows verifying fewer drafts, rows that cannot accept, D = 1..6."""
    del dtype  # integer work; run once per dtype like the other checks
    g = torch.Generator().manual_seed(4)
    for d in range(1, 7):
        b = 64
        argmax = torch.randint(0, 5, (b, d + 1), generator=g)
        drafts = torch.where(torch.rand(b, d, generator=g) < 0.7, argmax[:, :d], torch.randint(0, 5, (b, d), generator=g))
        num = torch.randint(0, d + 1, (b,), generator=g)
        can = torch.rand(b, generator=g) < 0.8
        args = [x.to(device) for x in (argmax, drafts, num, can)]
        acc, em = greedy_accept(*args)
        cols = torch.arange(d, device=device)
        ref_acc, ref_em = greedy_accept_ref(args[0], args[1], (cols[None, :] < args[2][:, None]) & args[3][:, None])
        assert torch.equal(acc, ref_acc) and torch.equal(em, ref_em), f"greedy accept, D={d}"
        assert int(ref_acc.max()) == d or d > 4, "the check should reach full acceptance"
        # forced acceptance (spec.accept): the same draws as its PyTorch ops, seeds spanning 64 bits
        seeds = torch.randint(-2 ** 62, 2 ** 62, (b,), generator=g)
        offsets = torch.randint(0, 100000, (b,), generator=g)
        for forced in (0.0, 1.5, d - 0.25, float(d)):
            off = torch.zeros(b, dtype=torch.bool)
            sampling = SamplingTensors(*(torch.zeros(b) for _ in range(4)), seeds, offsets, True, False)
            a = spec_accept.AcceptInputs(sampling, greedy=~off, can_accept=can, relaxed=off,
                                         relaxed_topk=torch.ones(b, dtype=torch.int64), relaxed_delta=torch.zeros(b),
                                         thinking=off, simple_greedy=True)
            ref_acc = spec_accept._forced(forced, num, a)
            ref = (ref_acc, spec_accept.emit(drafts, argmax[torch.arange(b), ref_acc], ref_acc))
            draw = spec_accept.ForcedDraw(int(forced), forced - int(forced), seeds.to(device), offsets.to(device),
                                          spec_accept._FORCED_SALT ^ spec_accept._ACCEPT_SALT)
            got = greedy_accept(*args, forced=draw)
            assert all(torch.equal(x.cpu(), y) for x, y in zip(got, ref)), f"forced acceptance {forced}, D={d}"


@kernel_check
def check_argmax(device, dtype):
    """Exact, ties included: the lowest index of the maximum, within a chunk and across chunks."""
    g = torch.Generator().manual_seed(5)
    for rows, v in ((1, 49152), (5, 128256), (7, CHUNK), (3, 1000), (64, 32000)):
        x = torch.randn(rows, v, generator=g).to(dtype)
        x[0, v // 3] = x[0, v - 1] = 50.0  # a tie across chunks: the first one wins
        if rows > 2:
            x[1, 7] = x[1, 8] = 50.0  # a tie inside a chunk
            x[2] = float("-inf")  # nothing finite: index 0, like torch
        x = x.to(device)
        got = argmax_lastdim(x)
        ref = x.float().cpu().argmax(dim=-1).to(device)
        assert torch.equal(got, ref), f"argmax {rows}x{v} {dtype}"
        assert int(got[0]) == v // 3
    x = torch.randn(2, 5, 3000, generator=g).to(device=device, dtype=dtype)  # leading dims
    assert torch.equal(argmax_lastdim(x), x.argmax(dim=-1))
    ids = torch.randperm(50000, generator=g)[:3000].to(device)  # a draft vocabulary's target ids
    assert torch.equal(argmax_lastdim(x, ids), ids[x.argmax(dim=-1)])


@kernel_check
def check_embed_norm_cat(device, dtype):
    """EAGLE-3 / MTP input: cat(norm(embedding of ids), norm(hidden)) in one kernel == the three ops."""
    g = torch.Generator().manual_seed(6)
    for n, h in ((1, 576), (7, 64), (3, 1000)):
        table = torch.randn(300, h, generator=g).to(device, dtype)
        ids = torch.randint(0, 300, (n,), generator=g).to(device)
        hidden = torch.randn(n, h, generator=g).to(device, dtype)
        w1, w2 = ((1 + 0.1 * torch.randn(h, generator=g)).to(device, dtype) for _ in range(2))
        got = embed_norm_cat(ids, table, w1, hidden, w2, 1e-5)
        ref = torch.cat((rms_norm_ref(table[ids], w1, 1e-5), rms_norm_ref(hidden, w2, 1e-5)), dim=-1)
        assert got.shape == (n, 2 * h) and got.dtype == ref.dtype
        _close(got, ref, dtype, "embed_norm_cat")


@kernel_check
def check_step_inputs(device, dtype):
    """A graph step's record expanded in one kernel == the PyTorch ops (exact: integers and flags)."""
    g = torch.Generator().manual_seed(7)
    for b, q, m, d in ((1, 1, 16, None), (3, 5, 32, 4), (8, 5, 64, 4), (1, 64, 16, 4), (4, 3, 16, 2)):
        real = max(1, b - 1)  # the last row is a dummy when b > 1
        count = torch.randint(1, q + 1, (b,), generator=g)
        count[real:] = 1
        nd = torch.minimum(torch.randint(0, (d or 0) + 1, (b,), generator=g), count - 1)
        nd[real:] = 0
        start = torch.randint(0, 16 * m - 2 * q, (b,), generator=g)
        start[real:] = 0
        tokens = torch.randint(0, 1000, (b, q), generator=g) * (torch.arange(q) < count[:, None])
        tables = torch.randint(1, 500, (b, m), generator=g)
        flags = torch.randint(0, 2, (4, b), generator=g) if d else None
        args = [x.to(device) for x in (start, count, nd, tokens, tables)]
        kw = dict(num_drafts=d, flags=flags.to(device)) if d else {}
        got = expand_record(*args, 16, **kw)
        ref = expand_record_ref(*args, 16, **kw)
        assert got.keys() == ref.keys()
        for k in ref:
            assert got[k].dtype == ref[k].dtype and torch.equal(got[k], ref[k]), f"step inputs {k} {b}x{q} D={d}"


@kernel_check
def check_draft_inputs(device, dtype):
    """The draft loop's inputs after acceptance in one kernel == the PyTorch ops (exact), for a graph layout
    (every row q tokens) and a packed one (rows of different lengths), with rows that do not draft."""
    g = torch.Generator().manual_seed(8)
    for b, q, d, packed in ((1, 5, 4, False), (6, 5, 4, False), (5, 7, 3, True), (3, 2, 1, False), (40, 5, 4, False)):
        w, m, bs = q + d + 2, 8, 16
        counts = torch.randint(1, q + 1, (b,), generator=g) if packed else torch.full((b,), q)
        nd = torch.minimum(torch.randint(0, d + 1, (b,), generator=g), counts - 1)
        base_col = counts - 1 - nd
        accepted = (torch.rand(b, generator=g) * (nd + 1)).long()
        row = torch.repeat_interleave(torch.arange(b), counts)
        col = torch.cat([torch.arange(int(c)) for c in counts])
        ext = torch.randint(0, 1000, (b, w), generator=g)
        args = [accepted, torch.randint(0, 1000, (b, d + 1), generator=g), base_col,
                torch.cumsum(counts, 0) - counts, torch.randint(0, 100, (b,), generator=g), ext,
                torch.rand(b, generator=g) < 0.7, torch.randint(1, 60, (b, m), generator=g), row, col]
        args = [x.to(device) for x in args]
        for max_pos in (10_000, 60):  # the second clamps chain positions
            got = draft_inputs(*args, bs, d, max_pos)
            ref = draft_inputs_ref(*args, bs, d, max_pos)
            assert got.keys() == ref.keys()
            for k in ref:
                assert torch.equal(got[k], ref[k]), f"draft inputs {k} b={b} q={q} d={d} packed={packed}"


def check_gemv(device, dtype):
    # K loaded in one block or split in two (576 = 512 + 64); the weights loaded after the prologue or first
    old, wfirst = os.environ.get("SPECSERVE_GEMV_SPLITK"), gemv.WFIRST
    try:
        variants = (("0", False), ("1", True)) if QUICK else (("0", False), ("0", True), ("1", False), ("1", True))
        for split, first in variants:
            os.environ["SPECSERVE_GEMV_SPLITK"], gemv.WFIRST = split, first
            _check_gemv(device, dtype)
    finally:
        gemv.WFIRST = wfirst
        if old is None:
            del os.environ["SPECSERVE_GEMV_SPLITK"]
        else:
            os.environ["SPECSERVE_GEMV_SPLITK"] = old


@kernel_check
def _check_gemv(device, dtype):
    g = torch.Generator().manual_seed(9)
    # a partial block of output features (100 = 12 x 8 + 4, quick: 36), a width that is not a power of two, the
    # widest K and the most rows the kernels take
    for n, k, ts in ((36, 576, (1, 5)), (20, 2048, (8,))) if QUICK else \
            ((100, 576, (1, 5)), (40, 1000, (1, 5)), (20, 2048, (8,))):
        w = (0.05 * torch.randn(n, k, generator=g)).to(device, dtype)
        nw = (1 + 0.1 * torch.randn(k, generator=g)).to(device, dtype)
        bias = torch.randn(n, generator=g).to(device, dtype)
        for t in ts:
            x = torch.randn(t, k, generator=g).to(device, dtype)
            assert gemv_enabled(x, k), "the check would compare the reference with itself"
            # row strides of their own (the kernels must not mix them up)
            res = torch.randn(t, k + 16, generator=g).to(device, dtype)[:, :k]
            gu = torch.randn(t, 2 * k, generator=g).to(device, dtype)
            add = torch.randn(t, n + 8, generator=g).to(device, dtype)[:, :n]
            wide = torch.randn(t, k + 32, generator=g).to(device, dtype)[:, :k]
            for what, args in (("plain", (x, w)), ("bias", (x, w, bias)), ("strided", (wide, w)),
                               ("norm", (x, w, None, NORM, None, nw, 1e-5)),
                               ("add+norm", (x, w, bias, ADD_NORM, res, nw, 1e-5)),
                               ("silu-mul", (gu, w, None, SILU_MUL)),
                               ("silu-mul+add", (gu, w, bias, SILU_MUL, None, None, 0.0, add))):
                ref, rr = linear_ref(*args)
                out, r = fused_linear(*args)
                _close(out, ref, dtype, f"gemv {what} n={n} k={k} t={t}")
                assert (r is None) == (rr is None)
                if rr is not None:
                    assert torch.equal(r, rr), f"gemv residual n={n} k={k} t={t}"
            # the norm folded into its neighbours (SwiGLU.norm_folds): the o projection writing the stream and the
            # stream times the norm's weight, the down projection scaling gate and up by 1 / rms(stream)
            nw_n = (1 + 0.1 * torch.randn(n, generator=g)).to(device, dtype)
            sv, sc = gemv.linear_add_scaled(x, w, bias, add, nw_n)
            _close(sv, linear_ref(x, w, bias, add=add)[0], dtype, f"gemv add+scaled n={n} k={k} t={t}")
            assert torch.equal(sc, nw_n * sv), f"gemv scaled copy n={n} k={k} t={t}"
            stream = torch.randn(t, 3 * n + 5, generator=g).to(device, dtype)[:, :n + 5]  # its own width and stride
            for extra in (None, add):
                args = (gu, w, bias, gemv.SILU_MUL_RSTD, stream, None, 1e-5, extra)
                _close(fused_linear(*args)[0], linear_ref(*args)[0], dtype, f"gemv silu-mul/rms n={n} k={k} t={t}")
            # int8 rows with a scale each (a draft head's output layer): as the dequantized weights
            q, sc = gemv.quantize_rows(w)
            assert q.dtype == torch.int8 and (q.float() * sc[:, None] - w.float()).abs().max() <= sc.max() / 2 + 1e-6
            deq = (q.float() * sc[:, None]).to(dtype)
            for launch in ({}, {"block": 32, "num_warps": 4}):  # the default, and the output layer's (layers.py)
                out, _ = fused_linear(x, q, None, NORM, None, nw, 1e-5, scale=sc, **launch)
                _close(out, linear_ref(x, deq, None, NORM, None, nw, 1e-5)[0], dtype,
                       f"gemv int8 n={n} k={k} t={t} {launch}")
                # the argmax inside the projection: exactly the argmax of its outputs, ties to the lowest index
                ids = torch.randperm(4 * n, generator=g)[:n].to(device)
                for wq, scale in ((q, sc), (w, None)):
                    logits = fused_linear(x, wq, None, NORM, None, nw, 1e-5, scale=scale, **launch)[0]
                    for m in (None, ids):
                        got = gemv.fused_argmax(x, wq, NORM, nw, 1e-5, scale=scale, ids=m, **launch)
                        assert torch.equal(got, argmax_lastdim(logits, m)), f"gemv argmax n={n} k={k} t={t} {launch}"
            # every logit negative: the masked columns past N (a partial last block) must not win with a zero
            xp, wn = x.abs(), -w.abs()
            got = gemv.fused_argmax(xp, wn)
            assert torch.equal(got, argmax_lastdim(fused_linear(xp, wn)[0])) and int(got.max()) < n, \
                f"gemv argmax, negative logits n={n} k={k} t={t}"
            if t == 1:  # the best row copied to a lower index and to the last (other programs): the lowest wins
                j = int(argmax_lastdim(fused_linear(x, w, None, NORM, None, nw, 1e-5)[0])[0])
                tie = w.clone()
                tie[j // 2] = tie[n - 1] = w[j]
                got = gemv.fused_argmax(x, tie, NORM, nw, 1e-5)
                assert int(got[0]) == j // 2, f"gemv argmax ties n={n} k={k}"
            if t < 3:
                continue
            # with the same launch each token row rounds as it would alone
            bn = gemv.block_n(n, k, t)
            one, _ = fused_linear(x[2:3], w, bias, ADD_NORM, res[2:3], nw, 1e-5, block=bn)
            all_rows, _ = fused_linear(x, w, bias, ADD_NORM, res, nw, 1e-5, block=bn)
            assert torch.equal(one[0], all_rows[2]), "row independence"
            # a step with more programs than MAX_PROGRAMS: the prologue's kernel, then cuBLAS
            limit, gemv.MAX_PROGRAMS = gemv.MAX_PROGRAMS, 8
            try:
                for what, args in (("add+norm", (x, w, bias, ADD_NORM, res, nw, 1e-5)),
                                   ("silu-mul+add", (gu, w, bias, SILU_MUL, None, None, 0.0, add))):
                    out, r = fused_linear(*args)
                    ref, rr = gemv.linear_ref(*args, kernels=True)
                    assert torch.equal(out, ref), f"gemv beyond MAX_PROGRAMS {what}"
                    _close(out, linear_ref(*args)[0], dtype, f"gemv unfused {what} n={n} k={k} t={t}")
                    assert (r is None) == (rr is None) and (r is None or torch.equal(r, rr))
            finally:
                gemv.MAX_PROGRAMS = limit


@kernel_check
def check_norm_fold(device, dtype):
    """The MLP with the norm before it folded (``SwiGLU.from_stream`` after ``linear_add_scaled``) == the MLP
    after that norm (``SwiGLU.after_norm`` / ``after_norm_sum``), at the default model's widths (quick: small
    ones) and a verify step's 5 rows, where the engine folds."""
    from specserve.models.layers import RMSNorm, SwiGLU

    g = torch.Generator().manual_seed(7)
    for h, i, a in ((80, 192, 96),) if QUICK else ((576, 1536, 576), (64, 128, 96)):
        mlp = SwiGLU(h, i, bias=False)
        norm = RMSNorm(h, 1e-5)
        for p in (mlp.gate_up_proj.weight, mlp.down_proj.weight):
            p.copy_(torch.randn(p.shape, generator=g) / p.shape[1] ** 0.5)
        norm.weight.copy_(1 + 0.1 * torch.randn(h, generator=g))
        mlp.to(device, dtype)
        norm.to(device, dtype)
        w_o = (torch.randn(h, a, generator=g) / a ** 0.5).to(device, dtype)
        for t in (1, 5):
            attn = torch.randn(t, a, generator=g).to(device, dtype)
            stream = torch.randn(t, h, generator=g).to(device, dtype)
            s, scaled = gemv.linear_add_scaled(attn, w_o, None, stream, norm.weight)
            o = fused_linear(attn, w_o)[0]
            want, want_s = mlp.after_norm(norm, o, stream)
            _close(s, want_s, dtype, f"norm fold: stream h={h} t={t}")
            _close(mlp.from_stream(norm, s, scaled), want, dtype, f"norm fold: mlp h={h} t={t}")
            _close(mlp.from_stream(norm, s, scaled, add_stream=True), mlp.after_norm_sum(norm, o, stream), dtype,
                   f"norm fold: mlp + stream h={h} t={t}")


@kernel_check
def check_attn_merge_fold(device, dtype):
    """The o projection merging an attention step's split partial sums in its prologue (``gemv.merged_linear``)
    == the merge kernel, then the o projection (``fused_linear``; with the next norm folded,
    ``linear_add_scaled``), and near the SDPA reference: one verify row of 5 queries, and 3 decode rows."""
    from specserve.kernels.attention import AttnPartials, _flat_index

    g = torch.Generator().manual_seed(11)
    hq, hkv, d, h = (3, 1, 32, 40) if QUICK else (9, 3, 64, 576)
    n_blocks, bs, m = 128, 16, (20 if QUICK else 40)
    kc = torch.randn(n_blocks, bs, hkv, d, generator=g).to(device, dtype)
    vc = torch.randn(n_blocks, bs, hkv, d, generator=g).to(device, dtype)
    w = (torch.randn(h, hq * d, generator=g) / (hq * d) ** 0.5).to(device, dtype)
    bias = (0.1 * torch.randn(h, generator=g)).to(device, dtype)
    nw = (1 + 0.1 * torch.randn(h, generator=g)).to(device, dtype)
    for lens in ([(m * bs - 20, 5)], [(m * bs - 3, 1), (37, 1), (m * bs // 2, 1)]):
        qw = max(nq for _, nq in lens)
        t = sum(nq for _, nq in lens)
        tables = (torch.randperm(n_blocks - 1, generator=g)[:len(lens) * m] + 1).view(len(lens), m)
        qidx = torch.full((len(lens), qw), t, dtype=torch.int64)
        qpos = torch.zeros(len(lens), qw, dtype=torch.int64)
        t0 = 0
        for b, (ctx, nq) in enumerate(lens):
            qidx[b, :nq] = torch.arange(t0, t0 + nq)
            qpos[b, :nq] = torch.arange(ctx - nq, ctx)
            t0 += nq
        q = torch.randn(t, hq, d, generator=g).to(device, dtype)
        args = (q, kc, vc, tables.to(device), qidx.to(device), qpos.to(device), d ** -0.5)
        parts = paged_attention_triton(*args, flat_index=_flat_index(args[4], t))
        assert isinstance(parts, AttnPartials) and parts.num_splits > 1, "the step did not split its keys"
        stream = torch.randn(t, h, generator=g).to(device, dtype)
        got = gemv.merged_linear(parts, w, bias)
        got_s, got_scaled = gemv.merged_linear(parts, w, None, stream, nw)
        assert got is not None and got[1] is None, "the merged o projection did not take the few-row kernel"
        merged = parts.merge().view(t, hq * d)
        want = fused_linear(merged, w, bias)[0]
        want_s, want_scaled = gemv.linear_add_scaled(merged, w, None, stream, nw)
        exact = device == "cpu"  # the interpreter sums alike; a GPU compiler may contract the merge otherwise
        for a, b, what in ((got[0], want, "o"), (got_s, want_s, "o + stream"), (got_scaled, want_scaled, "scaled")):
            if exact:
                assert torch.equal(a, b), f"merged o projection ({what}, {len(lens)} rows) differs from merge + o"
            _close(a, b, dtype, f"merged o projection ({what}, {len(lens)} rows)")
        ref = paged_attention_sdpa(*args).reshape(t, hq * d)
        _close(got[0], linear_ref(ref, w, bias)[0], dtype, f"merged o projection against SDPA, {len(lens)} rows")


CHECKS = [check_norm, check_silu, check_rope_cache, check_attention, check_greedy_accept, check_argmax,
          check_embed_norm_cat, check_step_inputs, check_draft_inputs, check_gemv, check_qkv_rope, check_norm_fold,
          check_attn_merge_fold]

def dtypes(device: str):
    """bfloat16 on the GPU; Triton's interpreter cannot run tl.dot on bfloat16, so float16 stands in there."""
    return (torch.float32, torch.bfloat16, torch.float16) if device == "cuda" else (torch.float32, torch.float16)


if __name__ == "__main__":
    dev = sys.argv[1] if len(sys.argv) > 1 else "cpu"
    if os.environ.get("SPECSERVE_BUILD_SM"):  # interpreting: also build each kernel for that GPU (kernel_build.py)
        import kernel_build
        launched = kernel_build.record(("bf16",) if QUICK else ("fp16", "bf16"))
    for dt in dtypes(dev):
        for c in CHECKS:
            c(dev, dt)
            print(f"{c.__name__} {dt}: ok", flush=True)
    if os.environ.get("SPECSERVE_BUILD_SM"):
        kernel_build.build_recorded(launched, int(os.environ["SPECSERVE_BUILD_SM"]))
