"""The few-row linear kernels (``kernels/gemv.py``, ``gemv_rows.py``, ``qkv_rope.py``) against their PyTorch references:
every prologue, int8 weights, the argmax inside the projection, the norm folded into its neighbours and the
attention merge folded into the o projection. Part of ``kernel_checks.CHECKS``."""

from __future__ import annotations

import torch

from check_util import QUICK, _close, kernel_check
from specserve.kernels import gemv, gemv_rows, qkv_rope
from specserve.kernels.argmax import argmax_lastdim
from specserve.kernels.attention import paged_attention_sdpa, paged_attention_triton
from specserve.kernels.gemv import ADD_NORM, NONE, NORM, SILU_MUL, fused_linear, gemv_enabled, linear_ref
from specserve.kernels.gemv_rows import rows_linear, rows_takes
from specserve.kernels.norm import embed_norm_cat
from specserve.kernels.qkv_rope import EMBED_CAT, ROWS_PAIRS, ROWS_WARPS, _qkv_rows, qkv_rope_cache
from specserve.kernels.rope import rope_and_cache


def _qkv_setup(g, device, dtype):
    """A qkv + RoPE check's shapes and tensors: heads (q, kv), head size, cache blocks and block size, K; the
    weight [(Hq + 2 Hkv) D, K], a bias, a norm weight [K], and the cos / sin tables of 100 positions."""
    hq, hkv, d, blocks, bs, k = (3, 1, 32, 5, 16, 96) if QUICK else (9, 3, 64, 5, 16, 576)
    n = (hq + 2 * hkv) * d
    w = (0.05 * torch.randn(n, k, generator=g)).to(device, dtype)
    bias = torch.randn(n, generator=g).to(device, dtype)
    nw = (1 + 0.1 * torch.randn(k, generator=g)).to(device, dtype)
    freqs = torch.outer(torch.arange(100).float(), 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d)))
    return hq, hkv, d, blocks, bs, k, w, bias, nw, freqs.cos().to(device), freqs.sin().to(device)


@kernel_check
def check_qkv_rope(device, dtype):
    """The qkv projection with RoPE and the cache write inside against the projection and then the rope kernel
    (q heads rotated, k rotated and v as is into the cache; their sums run in another order, so close, not
    equal), for each prologue (a draft head's: against ``embed_norm_cat``), with and without a bias; a row of a
    3-row step (fewer rows than the several-row kernel takes: one program per row) exactly as the same row in
    steps of 1 and 2 rows (a verify row rounds as a decode row)."""
    g = torch.Generator().manual_seed(12)
    hq, hkv, d, blocks, bs, k, w, bias, nw, cos, sin = _qkv_setup(g, device, dtype)
    n, t = w.shape[0], 3
    assert t < gemv_rows.MIN_ROWS  # one program per row (check_qkv_rows has the several-row kernel)
    x = torch.randn(t, k, generator=g).to(device, dtype)
    res = torch.randn(t, k + 8, generator=g).to(device, dtype)[:, :k]
    w2 = (0.05 * torch.randn(n, 2 * k, generator=g)).to(device, dtype)  # EMBED_CAT's projection: [embedding, x]
    table = torch.randn(50, k, generator=g).to(device, dtype)
    nw_e = (1 + 0.1 * torch.randn(k, generator=g)).to(device, dtype)
    ids = torch.tensor([3, 49, 0], device=device)
    pos = torch.tensor([0, 17, 99], device=device)
    slots = torch.tensor([16, 33, 64], device=device)
    for pro, b in ((NONE, None), (NORM, bias), (ADD_NORM, bias), (ADD_NORM, None), (EMBED_CAT, None)):
        what = f"qkv+rope prologue={pro} bias={b is not None}"
        caches = [torch.zeros(2, blocks, bs, hkv, d, dtype=dtype, device=device) for _ in range(3)]

        def args(rows):
            return (x[rows], w2 if pro == EMBED_CAT else w, b, pro, res[rows] if pro == ADD_NORM else None,
                    None if pro == NONE else nw, 1e-5)

        def embed(rows):  # a draft head's input: a token's embedding and a hidden state, each normed
            return dict(embed=(ids[rows], table, nw_e)) if pro == EMBED_CAT else {}
        got = qkv_rope_cache(*args(slice(None)), pos, cos, sin, *caches[0], slots, hq, hkv, d, **embed(slice(None)))
        assert got is not None, "the check would compare the reference with itself"
        if pro == EMBED_CAT:
            qkv, r = fused_linear(embed_norm_cat(ids, table, nw_e, x, nw, 1e-5), w2)
        else:
            qkv, r = fused_linear(*args(slice(None)))
        q, kk, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
        ref_q = rope_and_cache(pos, q.view(t, hq, d), kk.view(t, hkv, d), v.view(t, hkv, d), cos, sin, *caches[1],
                               slots)
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


@kernel_check
def check_qkv_rows(device, dtype):
    """The several-row qkv + RoPE kernel (each weight block read once for all rows) against the projection
    and then the rope kernel, for prologues none / norm / residual add + norm, with and without a bias, 4, 5
    and 8 rows, two launches (nothing written to other cache slots, the new residual exact); and the choice: a
    5-row step takes it with the default launch, a 1-row step keeps the one-row kernel."""
    g = torch.Generator().manual_seed(14)
    hq, hkv, d, blocks, bs, k, w, bias, nw, cos, sin = _qkv_setup(g, device, dtype)
    x8 = torch.randn(8, k + 8, generator=g).to(device, dtype)[:, :k]
    res8 = torch.randn(8, k, generator=g).to(device, dtype)
    pos8 = torch.tensor([0, 5, 17, 40, 99, 3, 64, 1], device=device)
    slots8 = torch.tensor([16, 21, 33, 79, 64, 2, 50, 70], device=device)
    cases = [(NONE, None, 2, 5), (NORM, bias, 4, 5), (ADD_NORM, None, 4, 5), (NORM, None, 2, 4),
             (ADD_NORM, bias, 2, 5), (ADD_NORM, None, 4, 8)]
    for pro, b, warps, t in cases:
        what = f"qkv rows prologue={pro} bias={b is not None} warps={warps} t={t}"
        x, res, pos, slots = x8[:t], res8[:t], pos8[:t], slots8[:t]
        args = (x, w, b, pro, res if pro == ADD_NORM else None, None if pro == NONE else nw, 1e-5)
        caches = [torch.zeros(2, blocks, bs, hkv, d, dtype=dtype, device=device) for _ in range(2)]
        got = _qkv_rows(*args, pos, cos, sin, *caches[0], slots, hq, hkv, d, setting=(16, warps))
        assert got is not None, what + ": the kernel did not run"
        qkv, r = fused_linear(*args)
        q, kk, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
        ref_q = rope_and_cache(pos, q.view(t, hq, d), kk.view(t, hkv, d), v.view(t, hkv, d), cos, sin, *caches[1],
                               slots)
        _close(got[0], ref_q, dtype, what + ": q")
        _close(caches[0], caches[1], dtype, what + ": cache")
        written = torch.zeros(blocks * bs, dtype=torch.bool, device=device)
        written[slots] = True
        assert not caches[0].view(2, blocks * bs, hkv, d)[:, ~written].any(), what + ": a slot outside the step"
        assert (got[1] is None) == (r is None) and (r is None or torch.equal(got[1], r)), what + ": residual"
    args = (x8[:5], w, None, ADD_NORM, res8[:5], nw, 1e-5)
    cache = torch.zeros(2, blocks, bs, hkv, d, dtype=dtype, device=device)
    calls, qkv_rows = [], qkv_rope._qkv_rows
    qkv_rope._qkv_rows = lambda *a, **k: calls.append(a[0].shape[0]) or qkv_rows(*a, **k)
    try:
        got = qkv_rope_cache(*args, pos8[:5], cos, sin, *cache, slots8[:5], hq, hkv, d)
        qkv_rope_cache(x8[:1], *args[1:4], res8[:1], nw, 1e-5, pos8[:1], cos, sin, *cache, slots8[:1], hq, hkv, d)
    finally:
        qkv_rope._qkv_rows = qkv_rows
    assert calls == [5], f"the several-row kernel ran for steps of {calls} rows, not for the 5-row step only"
    want = _qkv_rows(*args, pos8[:5], cos, sin, *cache, slots8[:5], hq, hkv, d, setting=(ROWS_PAIRS, ROWS_WARPS))
    assert torch.equal(got[0], want[0]), "a 5-row step on the several-row kernel with the default launch"


@kernel_check
def check_gemv(device, dtype):
    g = torch.Generator().manual_seed(9)
    # a partial block of output features (100 = 12 x 8 + 4, quick: 36), a width that is not a power of two, the
    # widest K and the most rows the kernels take; K loaded split in two blocks (576 = 512 + 64) or as one
    # (1,000 in 1,024 columns; 2,048)
    assert gemv.k_blocks(576) == (512, 64) and gemv.k_blocks(1000) == (1024, 0) and gemv.k_blocks(2048) == (2048, 0)
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
                # without a prologue (drafts: the norm's weight folded into the int8 rows), into a strided column
                logits = fused_linear(x, q, None, NONE, scale=sc, **launch)[0]
                dest = torch.full((t, 3), -1, dtype=torch.int64, device=device)
                got = gemv.fused_argmax(x, q, scale=sc, ids=ids, out=dest[:, 1], **launch)
                assert torch.equal(dest[:, 1], argmax_lastdim(logits, ids)) and (dest[:, 0] == -1).all() \
                    and (dest[:, 2] == -1).all() and got.data_ptr() == dest[:, 1].data_ptr(), \
                    f"gemv argmax, no prologue, into a column n={n} k={k} t={t} {launch}"
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
def check_gemv_rows(device, dtype):
    """The several-row kernel (``gemv_rows``: each weight block read once for all rows) against ``F.linear``: K
    split in two power-of-two blocks or whole, a partial last block of features, rows with a stride of their own,
    2 to 8 rows, the default launch and another; and the choice (``rows_takes``): a several-row step takes the
    kernel with the default launch, a one-row step does not, nor a K whose launch would not fit its registers."""
    g = torch.Generator().manual_seed(13)
    # the last shape's K fits the default launch: the choice below reads it
    for n, k in ((40, 96), (36, 64)) if QUICK else ((40, 1000), (100, 576)):
        w = (0.05 * torch.randn(n, k, generator=g)).to(device, dtype)
        for t in (2, 5) if QUICK else (2, 5, 8):
            x = torch.randn(t, k + 8, generator=g).to(device, dtype)[:, :k]
            ref = torch.nn.functional.linear(x, w)
            default = (gemv_rows.BLOCK_N, gemv_rows.NUM_WARPS)
            for launch in (default, (16, 4)) if t == 5 else (default,):
                _close(rows_linear(x, w, *launch), ref, dtype, f"gemv rows {launch} n={n} k={k} t={t}")
    x = torch.randn(5, k, generator=g).to(device, dtype)
    assert rows_takes(x, w) and not rows_takes(x[:1], w)
    assert torch.equal(rows_linear(x, w), rows_linear(x, w, gemv_rows.BLOCK_N, gemv_rows.NUM_WARPS))
    # K = 1000 (1,024 padded): weights and rows would not fit
    wide = torch.zeros(5, 1000, device=device, dtype=dtype)
    assert rows_takes(wide[:, :64], torch.zeros(8, 64, device=device, dtype=dtype))
    assert not rows_takes(wide, torch.zeros(8, 1000, device=device, dtype=dtype))


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
        # gate/up by cuBLAS (one row; 5 rows with the several-row kernel's lower bound raised past them, as
        # for a model too wide for it), or by gemv_rows' kernel
        for t, rows in ((1, False), (5, False), (5, True)):
            attn = torch.randn(t, a, generator=g).to(device, dtype)
            stream = torch.randn(t, h, generator=g).to(device, dtype)
            s, scaled = gemv.linear_add_scaled(attn, w_o, None, stream, norm.weight)
            o = fused_linear(attn, w_o)[0]
            want, want_s = mlp.after_norm(norm, o, stream)
            _close(s, want_s, dtype, f"norm fold: stream h={h} t={t}")
            min_rows = gemv_rows.MIN_ROWS
            gemv_rows.MIN_ROWS = min_rows if rows else gemv.MAX_ROWS + 1
            try:
                assert rows_takes(scaled, mlp.gate_up_proj.weight) == rows
                _close(mlp.from_stream(norm, s, scaled), want, dtype, f"norm fold: mlp h={h} t={t} rows={rows}")
                _close(mlp.from_stream(norm, s, scaled, add_stream=True), mlp.after_norm_sum(norm, o, stream), dtype,
                       f"norm fold: mlp + stream h={h} t={t} rows={rows}")
            finally:
                gemv_rows.MIN_ROWS = min_rows


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
