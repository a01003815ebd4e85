"""A few-row step's qkv projection with RoPE and the KV-cache write in its epilogue: one kernel per decoder
layer instead of the projection (``gemv.fused_linear``) and ``rope.rope_and_cache``.

A program owns ``HB`` pairs of features (d, d + D/2) of one head, the pairs RoPE rotates together, so it can
rotate what it computed: q heads go to the rotated-q output, k heads rotated and v heads as they are to the
cache slot of the token. Each output is rounded as the two kernels round it (the projection to the
activations' dtype, then the rotation in float32 with cos / sin rounded to that dtype, as the kernel of
``rope_and_cache``); only the projection's sums run in another order than ``fused_linear``'s launch.
"""

from __future__ import annotations

import torch

from specserve.kernels import gemv, gemv_rows, kernel_failed, kernel_usable
from specserve.kernels.pdl import kernel_args

EMBED_CAT = gemv.Prologue.EMBED_CAT  # a draft head's layer: its input row built from a token's embedding and x
# Steps of ``gemv_rows.MIN_ROWS`` to ``gemv.MAX_ROWS`` rows on ``_qkv_rows_kernel``: 16 pairs per program, 4 warps
# (H200, a 5-row step's call 3.84 µs against 4.25 for one program per row, with 2 warps 4.72)
ROWS_PAIRS = 16
ROWS_WARPS = 4

from specserve.kernels._triton import HAVE_TRITON, tl, triton

if HAVE_TRITON:
    from specserve.kernels.gemv import _gemv_dot, _gemv_prologue, _gemv_weights
    from specserve.kernels.gemv_rows import _rows_add_norm, _rows_tile
    from specserve.kernels.pdl import pdl_begin, pdl_wait


def qkv_rope_cache(x, weight, bias, prologue, residual, norm_weight, eps, positions, cos_cache, sin_cache, k_cache,
                   v_cache, slot_mapping, hq: int, hkv: int, d: int, embed=None):
    """x [T, K]; weight [(Hq + 2 Hkv) * D, K] -> (rotated q [T, Hq, D], new residual stream or None) with k
    (rotated) and v written to the caches [blocks, block_size, Hkv, D] at ``slot_mapping`` [T]; or None where
    the kernel does not apply (the caller then runs ``fused_linear`` and ``rope_and_cache``). A step of
    ``gemv_rows.MIN_ROWS`` to ``gemv.MAX_ROWS`` rows without EMBED_CAT runs ``_qkv_rows_kernel`` where that
    applies, each weight block read once for all rows; other steps one program per row. ``embed`` = (ids [T],
    table [V, H], embedding norm weight [H]) with prologue EMBED_CAT: the input row is ``embed_norm_cat``'s,
    cat(norm(table[ids]), norm(x)) [2H] (a draft head's layer; ``norm_weight`` is the hidden half's), K = 2H."""
    n, k = weight.shape
    half = d // 2
    kx = k // 2 if prologue == EMBED_CAT else k  # the width of x (and of each half's norm)
    rows = (residual, norm_weight, bias) + ((embed[1], embed[2]) if prologue == EMBED_CAT else ())
    if (not kernel_usable("qkv_rope") or d % 2 or n != (hq + 2 * hkv) * d
            or (prologue == EMBED_CAT) != (embed is not None) or x.shape[-1] != kx
            or k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1 or not gemv._fusable(x, weight, *rows)):
        return None
    t = x.shape[0]
    if prologue in (gemv.NONE, gemv.NORM, gemv.ADD_NORM) and gemv_rows.MIN_ROWS <= t <= gemv.MAX_ROWS \
            and kernel_usable("qkv_rows"):
        fused = _qkv_rows(x, weight, bias, prologue, residual, norm_weight, eps, positions, cos_cache, sin_cache,
                          k_cache, v_cache, slot_mapping, hq, hkv, d)
        if fused is not None:
            return fused
    # pairs per program: a power of two dividing D/2, from x's width (EMBED_CAT: one half of the input row); the
    # same for any number of rows (twice as many for several rows, as ``gemv.WIDE`` does, was not adopted)
    hb = max(1, min(gemv.block_n(n, kx, 1) // 2, half & -half))
    programs = (hq + 2 * hkv) * (half // hb)
    if not gemv._programs_ok(programs, t):
        return None
    q_out = torch.empty(t, hq, d, dtype=x.dtype, device=x.device)
    res_out = torch.empty(t, k, dtype=x.dtype, device=x.device) if prologue == gemv.ADD_NORM else None
    ids, table, w_embed = embed if embed is not None else (positions, x, x)
    k1, k2 = gemv.k_blocks(kx)
    try:
        _qkv_rope_kernel[(programs, t)](
            x, residual if residual is not None else x, res_out if res_out is not None else q_out,
            norm_weight if norm_weight is not None else weight, weight, bias if bias is not None else weight,
            ids, table, w_embed, q_out, k_cache, v_cache, positions, slot_mapping, cos_cache, sin_cache, eps,
            x.stride(0), residual.stride(0) if residual is not None else 0, table.stride(0), weight.stride(0),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), cos_cache.stride(0), k_cache.shape[1], K=kx,
            PROLOGUE=int(prologue), HAS_BIAS=bias is not None, HB=hb, HALF=half, HQ=hq, HKV=hkv, K1=k1, K2=k2,
            **kernel_args(x))
    except Exception as e:  # not built here (first launch; never inside a capture)
        kernel_failed("qkv_rope", e)
        return None
    return q_out, res_out


def _qkv_rows(x, weight, bias, prologue, residual, norm_weight, eps, positions, cos_cache, sin_cache, k_cache,
              v_cache, slot_mapping, hq, hkv, d, setting=None):
    """``qkv_rope_cache`` for a step of several rows on ``_qkv_rows_kernel``, or None where it does not apply
    (``setting``: (pairs, warps), else (``ROWS_PAIRS``, ``ROWS_WARPS``); benchmarks and tests name others)."""
    hb, warps = setting or (ROWS_PAIRS, ROWS_WARPS)
    t, k, half = x.shape[0], weight.shape[1], d // 2
    hb = min(hb, half)
    # tl.dot's N is at least 16; wider K than ``gemv_rows.fits`` spills (K = 1,536 at 16 pairs / 4 warps: 488
    # bytes a thread, 2,048: 9.5 KB; ``benchmarks/kernel_spills.py``)
    if half % hb or hb < 16 or weight.dtype != x.dtype or not gemv_rows.fits(k, 2 * hb, warps):
        return None
    k1, k2 = gemv_rows.dot_blocks(k)
    q_out = torch.empty(t, hq, d, dtype=x.dtype, device=x.device)
    res_out = torch.empty(t, k, dtype=x.dtype, device=x.device) if prologue == gemv.ADD_NORM else None
    try:
        _qkv_rows_kernel[((hq + 2 * hkv) * (half // hb),)](
            x, residual if residual is not None else x, res_out if res_out is not None else q_out,
            norm_weight if norm_weight is not None else weight, weight, bias if bias is not None else weight,
            q_out, k_cache, v_cache, positions, slot_mapping, cos_cache, sin_cache, eps, x.stride(0),
            residual.stride(0) if residual is not None else 0, weight.stride(0), k_cache.stride(0),
            k_cache.stride(1), k_cache.stride(2), cos_cache.stride(0), k_cache.shape[1], T=t, TP=16, K=k, K1=k1,
            K2=k2, PROLOGUE=int(prologue), HAS_BIAS=bias is not None, HB=hb, HALF=half, HQ=hq,
            HKV=hkv, PREC="ieee" if x.dtype == torch.float32 else "tf32", num_warps=warps, **kernel_args(x))
    except Exception as e:  # not built here (first launch; never inside a capture)
        kernel_failed("qkv_rows", e)
        return None
    return q_out, res_out


if HAVE_TRITON:
    @triton.jit
    def _qkv_rope_kernel(X, RES, RES_OUT, NW, W, BIAS, IDS, E, NWE, QO, KC, VC, POS, SLOT, COS, SIN, eps, s_x, s_r,
                         s_e, s_w, sc_blk, sc_slot, sc_h, s_cos, BS, K: tl.constexpr, PROLOGUE: tl.constexpr,
                         HAS_BIAS: tl.constexpr, HB: tl.constexpr, HALF: tl.constexpr, HQ: tl.constexpr,
                         HKV: tl.constexpr, K1: tl.constexpr, K2: tl.constexpr, PDL: tl.constexpr):
        """K: the width of x (EMBED_CAT: of each half of the input row). The weights are loaded first, before
        the prologue (as ``gemv._gemv_acc``), and with PDL before the predecessor kernel completes."""
        pdl_begin(PDL)
        pid = tl.program_id(0)
        t = tl.program_id(1).to(tl.int64)  # the token row
        head = pid // (HALF // HB)  # q heads, then k heads, then v heads
        c = (pid % (HALF // HB)) * HB + tl.arange(0, HB)  # the pairs' first features, within the head's half
        cols1 = head * 2 * HALF + c  # [HB]
        cols2 = cols1 + HALF
        nm = c < HALF
        if PROLOGUE == 4:  # EMBED_CAT: columns [0, K) take norm(E[id]) (weights NWE), [K, 2K) norm(x) (NW)
            w1, w2 = _gemv_weights(W, cols1, nm, s_w, K, K1, K2)
            u1, u2 = _gemv_weights(W, cols2, nm, s_w, K, K1, K2)
            v1, v2 = _gemv_weights(W + K, cols1, nm, s_w, K, K1, K2)
            z1, z2 = _gemv_weights(W + K, cols2, nm, s_w, K, K1, K2)
            pdl_wait(PDL)
            tok = tl.load(IDS + t).to(tl.int64)
            e1, e2 = _gemv_prologue(E, RES, RES_OUT, NWE, tok, eps, s_e, 0, pid, K, 1, K1, K2, 1, 1)
            a1, a2 = _gemv_prologue(X, RES, RES_OUT, NW, t, eps, s_x, 0, pid, K, 1, K1, K2, 1, 1)
            p1 = _gemv_dot(w1, w2, e1, e2, K2) + _gemv_dot(v1, v2, a1, a2, K2)
            p2 = _gemv_dot(u1, u2, e1, e2, K2) + _gemv_dot(z1, z2, a1, a2, K2)
        else:
            w1, w2 = _gemv_weights(W, cols1, nm, s_w, K, K1, K2)
            u1, u2 = _gemv_weights(W, cols2, nm, s_w, K, K1, K2)
            pdl_wait(PDL)
            a1, a2 = _gemv_prologue(X, RES, RES_OUT, NW, t, eps, s_x, s_r, pid, K, PROLOGUE, K1, K2, 1, 1)
            p1 = _gemv_dot(w1, w2, a1, a2, K2)
            p2 = _gemv_dot(u1, u2, a1, a2, K2)
        if HAS_BIAS:
            p1 += tl.load(BIAS + cols1).to(tl.float32)
            p2 += tl.load(BIAS + cols2).to(tl.float32)
        # the projection's outputs as its own kernel would store them
        p1 = p1.to(X.dtype.element_ty)
        p2 = p2.to(X.dtype.element_ty)
        slot = tl.load(SLOT + t)
        base = (slot // BS) * sc_blk + (slot % BS) * sc_slot + c
        if head >= HQ + HKV:  # v: to the cache unrotated
            vo = VC + base + (head - HQ - HKV) * sc_h
            tl.store(vo, p1.to(VC.dtype.element_ty))
            tl.store(vo + HALF, p2.to(VC.dtype.element_ty))
        else:
            pos = tl.load(POS + t)
            cos = tl.load(COS + pos * s_cos + c).to(X.dtype.element_ty).to(tl.float32)
            sin = tl.load(SIN + pos * s_cos + c).to(X.dtype.element_ty).to(tl.float32)
            r1 = p1.to(tl.float32) * cos - p2.to(tl.float32) * sin
            r2 = p2.to(tl.float32) * cos + p1.to(tl.float32) * sin
            if head < HQ:
                qo = QO + t * (HQ * 2 * HALF) + head * (2 * HALF) + c
                tl.store(qo, r1.to(QO.dtype.element_ty))
                tl.store(qo + HALF, r2.to(QO.dtype.element_ty))
            else:
                ko = KC + base + (head - HQ) * sc_h
                tl.store(ko, r1.to(KC.dtype.element_ty))
                tl.store(ko + HALF, r2.to(KC.dtype.element_ty))

    @triton.jit
    def _qkv_rows_kernel(X, RES, RES_OUT, NW, W, BIAS, QO, KC, VC, POS, SLOT, COS, SIN, eps, s_x, s_r, s_w, sc_blk,
                         sc_slot, sc_h, s_cos, BS, T: tl.constexpr, TP: tl.constexpr, K: tl.constexpr,
                         K1: tl.constexpr, K2: tl.constexpr, PROLOGUE: tl.constexpr, HAS_BIAS: tl.constexpr,
                         HB: tl.constexpr, HALF: tl.constexpr, HQ: tl.constexpr, HKV: tl.constexpr,
                         PREC: tl.constexpr, PDL: tl.constexpr):
        """``_qkv_rope_kernel``'s outputs for all T rows (padded to TP) at once: a program owns HB pairs of one
        head and forms their sums with one ``tl.dot`` (float32 accumulation), each weight block loaded once,
        before the predecessor completes. PROLOGUE NORM / ADD_NORM: ``_rows_add_norm`` (rounded as the one-row
        kernel's prologue; with the norm applied to the sums instead, the rows' tile and its product were both
        live and spilled, 6.3 µs a call against 3.8)."""
        pdl_begin(PDL)
        pid = tl.program_id(0)
        head = pid // (HALF // HB)  # q heads, then k heads, then v heads
        c = (pid % (HALF // HB)) * HB + tl.arange(0, HB)  # [HB] the pairs' first features within the half
        nm = c < HALF
        # the block's weight rows interleaved, (d, d + HALF) for each pair: one dot of 2 HB features, whose
        # columns split back into the two halves (two dots of HB each held both weight blocks and a copy of
        # the rows per warp, and spilled)
        j = tl.arange(0, 2 * HB)
        cols = head * 2 * HALF + (pid % (HALF // HB)) * HB + j // 2 + (j % 2) * HALF  # [2 HB]
        w1, w2 = _gemv_weights(W, cols, cols >= 0, s_w, K, K1, K2)  # [2 HB, K1], [2 HB, K2]
        bias = tl.zeros([2 * HB], dtype=tl.float32)
        if HAS_BIAS:
            bias = tl.load(BIAS + cols).to(tl.float32)
        pdl_wait(PDL)
        rows = tl.arange(0, TP)[:, None]  # [TP, 1]; rows past T read as zeros and are not stored
        rm = rows < T
        ks1 = tl.arange(0, K1)
        ks2 = ks1
        if K2 > 0:
            ks2 = K1 + tl.arange(0, K2)
        x1, x2 = _rows_tile(X, rows, ks1, ks2, s_x, T, K, K2)
        if PROLOGUE > 0:
            x1, x2 = _rows_add_norm(x1, x2, RES, RES_OUT, NW, rows, ks1, ks2, eps, s_r, T, K, K2, PROLOGUE == 2)
        acc = tl.dot(x1, tl.trans(w1), input_precision=PREC)  # [TP, 2 HB] float32
        if K2 > 0:
            acc = tl.dot(x2, tl.trans(w2), acc, input_precision=PREC)
        # the projection's outputs as its own kernel would store them, then the halves apart: [TP, HB] each
        acc = (acc + bias[None, :]).to(X.dtype.element_ty).to(tl.float32)
        p1, p2 = tl.split(tl.reshape(acc, [TP, HB, 2]))
        om = rm & nm[None, :]
        slot = tl.load(SLOT + rows, mask=rm, other=0)
        base = (slot // BS) * sc_blk + (slot % BS) * sc_slot + c[None, :]  # [TP, HB]
        if head >= HQ + HKV:  # v: to the cache unrotated
            vo = VC + base + (head - HQ - HKV) * sc_h
            tl.store(vo, p1.to(VC.dtype.element_ty), mask=om)
            tl.store(vo + HALF, p2.to(VC.dtype.element_ty), mask=om)
        else:
            pos = tl.load(POS + rows, mask=rm, other=0)
            cos = tl.load(COS + pos * s_cos + c[None, :], mask=om, other=0.0).to(X.dtype.element_ty).to(tl.float32)
            sin = tl.load(SIN + pos * s_cos + c[None, :], mask=om, other=0.0).to(X.dtype.element_ty).to(tl.float32)
            r1 = p1 * cos - p2 * sin
            r2 = p2 * cos + p1 * sin
            if head < HQ:
                qo = QO + rows * (HQ * 2 * HALF) + head * (2 * HALF) + c[None, :]
                tl.store(qo, r1.to(QO.dtype.element_ty), mask=om)
                tl.store(qo + HALF, r2.to(QO.dtype.element_ty), mask=om)
            else:
                ko = KC + base + (head - HQ) * sc_h
                tl.store(ko, r1.to(KC.dtype.element_ty), mask=om)
                tl.store(ko + HALF, r2.to(KC.dtype.element_ty), mask=om)
