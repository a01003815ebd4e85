"""Few-row linear layers with their elementwise prologue inside: one kernel where cuBLAS needs two or three.

A decode or verify step of a small model is latency-bound: the H200 profile of the default model
(docs/BENCHMARKS.md) shows ~270 kernels of 1-4 µs per step, cuBLAS's GEMMs among them taking ~4 µs to read
~1 MB of weights. For steps of at most ``MAX_ROWS`` tokens and reduced widths of at most ``MAX_K``, a
program here owns one token row and ``BLOCK_N`` output features: it loads those weight rows whole (one round
of loads, no loop over K), computes the row's prologue — nothing, (residual add +) RMSNorm, or SiLU(gate) * up
— and writes ``BLOCK_N`` outputs. The rows of a step run side by side (their weight reads after the first come
from L2), and each row's arithmetic is the same whatever the number of rows, so a verify step of 1 + D
tokens would round every token as a decode step does; but the launch is chosen per row count (``block_n``),
and a step of more than ``MAX_PROGRAMS`` programs runs cuBLAS (after the prologue's kernel, or with the norm
folded into its neighbours, ``linear_add_scaled`` and SILU_MUL_RSTD), so verify rows may
round unlike decode rows, as they did with cuBLAS alone (bfloat16 outputs with and without speculation can
part at near-ties; float32 on the CPU stays exact). Prologue rounding follows the unfused kernels
(``rms_norm_ref``, ``silu_and_mul_ref``); only the dot product's summation order differs from cuBLAS.
(Tile kernels taking all rows of a step in one program per feature block, each projection with its prologue, were
slower on the H200, looping over K or loading it whole. Without a prologue, a verify step's gate/up is faster that
way: ``gemv_rows``.)
"""

from __future__ import annotations

import enum

import torch
import torch.nn.functional as F

from specserve.kernels import kernel_failed, kernel_usable, use_triton
from specserve.kernels.activation import silu_and_mul, silu_and_mul_ref
from specserve.kernels.argmax import argmax_lastdim, argmax_pick, pick_fits
from specserve.kernels.norm import rms_norm, rms_norm_ref
from specserve.kernels.pdl import kernel_args

from specserve.kernels._triton import HAVE_TRITON, tl, triton

if HAVE_TRITON:
    from specserve.kernels.pdl import pdl_begin, pdl_wait

MAX_ROWS = 8  # tokens per step that take these kernels (more: cuBLAS, whose tiles reuse the weights better)
MAX_K = 2048  # widest reduced dimension loaded in one piece
TILE = 8192  # weight elements per program (BLOCK_N * padded K): 64 per thread at 4 warps
# More programs than this (token rows x feature blocks) run on cuBLAS instead (see linear_ref): on the
# H200 the gate/up projection of a 1 + 4-token verify step (1,920 programs) took 7.4-8.8 µs in every launch
# tried, cuBLAS and the norm kernel 6.0; 1,024 keeps every other projection of the default model's verify steps
# on these kernels, and with ``WIDE`` tiles (960 programs) that one.
MAX_PROGRAMS = 1024


class Prologue(enum.IntEnum):
    """What a few-row projection computes from its input row before the dot products. The kernels take the value
    as their ``PROLOGUE`` constexpr (an int: the wrappers pass ``int(prologue)``)."""
    NONE = 0  # the row as it is
    NORM = 1  # RMSNorm(x)
    ADD_NORM = 2  # RMSNorm(x + residual); the sum is the new residual stream, written by the kernel too
    SILU_MUL = 3  # SiLU(gate) * up of a gate/up projection's output [T, 2K]
    # a draft head's layer input cat(norm(embedding[ids]), norm(x)) [2H], built in place (``qkv_rope`` only)
    EMBED_CAT = 4
    # SiLU(gate) * up of a gate/up projection run on the stream s times the norm's weight (``norm_folds``):
    # gate and up are first scaled by the row's 1 / rms(s), the ``residual`` argument holding s [T, H]
    SILU_MUL_RSTD = 5
    # The o projection of a step whose attention split its keys merges the splits' partial sums in its prologue
    # (``merged_linear``): one merge kernel fewer per layer
    ATTN_MERGE = 6


NONE, NORM, ADD_NORM, SILU_MUL = Prologue.NONE, Prologue.NORM, Prologue.ADD_NORM, Prologue.SILU_MUL
SILU_MUL_RSTD, ATTN_MERGE = Prologue.SILU_MUL_RSTD, Prologue.ATTN_MERGE
# The attention step leaves its splits unmerged for the o projection's ATTN_MERGE prologue where
# ``merges_splits``; the attention reads it through ``models.llama.MERGE_FOLD``, which the engine check sets False
# to run the merge kernel instead
MERGE_FOLD = True
MERGE_MAX_SPLITS = 8  # every program merges every split (tables up to 2,048 keys); longer ones: the merge kernel
# Several-row steps take this many times the features per program ``block_n``'s fitted rules give: with
# programmatic dependent launch (kernels/pdl.py) a kernel's successor overlaps it only once all its programs have
# started, so fewer, wider programs won (the fitted rules alone timed slower on the H200).
WIDE = 2


def gemv_enabled(x: torch.Tensor, k: int) -> bool:
    """Whether a step with input ``x`` [T, *] and reduced width ``k`` takes these kernels."""
    return x.dim() == 2 and x.stride(-1) == 1 and _rows_enabled(x, x.shape[0], k)


def _rows_enabled(like: torch.Tensor, t: int, k: int) -> bool:
    """Whether a ``t``-row step of ``like``'s dtype and device with reduced width ``k`` takes these kernels."""
    return (use_triton(like) and kernel_usable("gemv")
            and 0 < t <= MAX_ROWS and k <= MAX_K and like.dtype in (torch.float32, torch.bfloat16, torch.float16))


def block_n(n: int, k: int, t: int = 1) -> int:
    """Output features per program for an [n, k] weight and ``t`` token rows. One row: a fixed tile. Several:
    fitted to the H200 at 5 rows: a wide K takes twice the
    features per program (the down projection: 4.05 against 4.74 µs), and a projection with few programs
    takes half as many (the o projection, 360 -> 720 programs: 2.39 against 2.61 µs); then ``WIDE`` times that
    (a 1 + 4-token verify step's gate/up projection: 960 programs, on this kernel instead of cuBLAS)."""
    bn = max(1, min(TILE // triton.next_power_of_2(k), triton.next_power_of_2(n)))
    if t > 1:
        if k > 1024:
            bn *= 2
        elif bn > 1 and triton.cdiv(n, bn) * t < 512:
            bn //= 2
        bn = min(bn * WIDE, triton.next_power_of_2(n))
    return bn


def linear_ref(x, weight, bias=None, prologue: Prologue = NONE, residual=None, norm_weight=None, eps: float = 0.0,
               add=None, kernels: bool = False):
    """x [T, K] (SILU_MUL, SILU_MUL_RSTD: [T, 2K]) -> (prologue(x) @ W.T + b (+ add) [T, N], new residual or None).
    SILU_MUL_RSTD: ``residual`` is the stream s [T, H] whose 1 / rms (with ``eps``) scales x first (PyTorch ops
    either way). ``kernels``: the prologue through its own kernel (``rms_norm``, ``silu_and_mul``: Triton on the
    GPU) instead of PyTorch ops, then cuBLAS, for steps with too many programs for ``fused_linear``; such rows
    sum in cuBLAS's order, so they round unlike a one-row step's."""
    norm, silu = (rms_norm, silu_and_mul) if kernels else (rms_norm_ref, silu_and_mul_ref)
    new_res = None
    if prologue == SILU_MUL_RSTD:
        s32 = residual.float()
        x = (x.float() * torch.rsqrt(s32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
        prologue = SILU_MUL
    if prologue == SILU_MUL:
        x = silu(x)
    elif prologue == NORM:
        x = norm(x, norm_weight, eps)
    elif prologue == ADD_NORM:
        x, new_res = norm(x, norm_weight, eps, residual)
    out = F.linear(x, weight, bias)
    return (out if add is None else out + add), new_res


def k_blocks(k: int) -> tuple[int, int]:
    """The reduced width as loaded: (K1, K2), the largest power of two below K and the power of two covering
    the rest (576 = 512 + 64 instead of 1,024 columns of which 448 masked off: fewer registers and lanes), where
    that is narrower than one block of the next power of two; else (that block, 0)."""
    full = triton.next_power_of_2(k)
    if full == k:
        return full, 0
    k1 = full // 2
    k2 = triton.next_power_of_2(k - k1)
    return (k1, k2) if k1 + k2 < full else (full, 0)


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (int8 [N, K], float32 scale [N]): symmetric, one scale per output feature (row)."""
    w = weight.float()
    scale = w.abs().amax(dim=1).clamp_min(1e-12) / 127.0
    return torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8), scale


def _dequantized(weight, scale, dtype):
    """An int8 weight with its row scales as ``dtype`` (the reference paths); any other weight as it is."""
    return weight if scale is None else (weight.float() * scale[:, None]).to(dtype)


def fused_linear(x, weight, bias=None, prologue: Prologue = NONE, residual=None, norm_weight=None, eps: float = 0.0,
                 add=None, block: int | None = None, num_warps: int = 4, scale=None):
    """``linear_ref`` in one kernel where ``gemv_enabled`` (``add`` [T, N] is added before the one rounding);
    ``block`` / ``num_warps`` override the launch (benchmarks). ADD_NORM returns the new residual stream
    (x + residual) as the second value. ``scale`` [N] float32: ``weight`` is int8, output feature j's
    weights being ``weight[j] * scale[j]`` (``quantize_rows``; a draft head's output layer, read at half the
    bytes of bfloat16)."""
    def ref(kernels: bool = False):  # the reference path (an int8 weight dequantized only then)
        return linear_ref(x, _dequantized(weight, scale, x.dtype), bias, prologue, residual, norm_weight, eps, add,
                          kernels=kernels)

    if not _fusable(x, weight, residual, add, norm_weight, bias):
        return ref()
    t, (n, k) = x.shape[0], weight.shape
    bn = block or block_n(n, k, t)
    if block is None and not _programs_ok(triton.cdiv(n, bn), t):
        return ref(kernels=True)
    out = torch.empty(t, n, dtype=x.dtype, device=x.device)
    res_out = torch.empty(t, k, dtype=x.dtype, device=x.device) if prologue == ADD_NORM else None
    if not _launch(x, weight, bias, prologue, residual, norm_weight, eps, add, scale, out, res_out, None, bn,
                   num_warps):
        return ref()
    return out, res_out


def linear_add_scaled(x, weight, bias, add, norm_weight, block: int | None = None, num_warps: int = 4):
    """x [T, K] -> (s = x @ W.T + b + add [T, N], s * norm_weight [T, N]), the second rounded as ``rms_norm_ref``
    rounds its last product: a layer's o projection writing the new residual stream and the input of a GEMM
    that a following RMSNorm folds into (``SwiGLU.from_stream``). One kernel where ``fused_linear`` would be."""
    def ref():
        out = linear_ref(x, weight, bias, add=add)[0]
        return out, (norm_weight * out).to(out.dtype)

    if not _fusable(x, weight, add, norm_weight, bias):
        return ref()
    t, (n, k) = x.shape[0], weight.shape
    bn = block or block_n(n, k, t)
    if block is None and not _programs_ok(triton.cdiv(n, bn), t):
        return ref()
    out = torch.empty(t, n, dtype=x.dtype, device=x.device)
    scaled = torch.empty(t, n, dtype=x.dtype, device=x.device)
    if not _launch(x, weight, bias, NONE, None, None, 0.0, add, None, out, None, None, bn, num_warps,
                   (scaled, norm_weight)):
        return ref()
    return out, scaled


def merged_linear(parts, weight, bias=None, stream=None, norm_weight=None):
    """The o projection of an attention step left unmerged (``kernels.attention.AttnPartials``, out [T, Hq, D])
    -> (merged @ W.T + b [T, N], None), or with ``stream`` and ``norm_weight`` what ``linear_add_scaled`` gives
    for it: one kernel, the merge inside each program's prologue (rounded to the output's dtype as the merge
    kernel rounds it). None where the few-row kernel does not take the step (the caller merges first)."""
    x = parts.out.view(parts.out.shape[0], -1)  # [T, K]: its shape and dtype only (never read)
    t, (n, k) = x.shape[0], weight.shape
    if (parts.flat_index is None or parts.num_splits > MERGE_MAX_SPLITS or not merges_splits(parts.out, weight, t)
            or not _fusable(x, weight, stream, norm_weight, bias)):
        return None
    bn = merge_block_n(n, k, t)
    out = torch.empty(t, n, dtype=x.dtype, device=x.device)
    scaled = None if norm_weight is None else torch.empty(t, n, dtype=x.dtype, device=x.device)
    if not _launch(x, weight, bias, ATTN_MERGE, None, None, 0.0, stream, None, out, None, None, bn, 4,
                   None if scaled is None else (scaled, norm_weight), merge=parts):
        return None
    return out, scaled


def merge_block_n(n: int, k: int, t: int) -> int:
    """Output features per program of ``merged_linear``: twice ``block_n``'s for several rows. Each program
    merges its row's splits again, so fewer, wider programs merge less often: a 1 + 4-token verify step of the
    default model (o projection 16 features a program, 180 programs, against 8 and 360) took 34-39 µs less on
    the H200 at contexts 256 and 512."""
    bn = block_n(n, k, t)
    if t == 1:
        return bn
    return min(2 * bn, triton.next_power_of_2(n))


def merges_splits(q: torch.Tensor, weight: torch.Tensor, t: int) -> bool:
    """Whether ``merged_linear`` takes the o projection through ``weight`` [N, K] of a ``t``-row attention step
    whose queries are ``q`` [*, Hq, D] (their dtype and device), merging its key splits in the prologue."""
    n, k = weight.shape
    return (MERGE_FOLD and _rows_enabled(q, t, k) and kernel_usable("gemv_merge") and weight.stride(1) == 1
            and _programs_ok(triton.cdiv(n, merge_block_n(n, k, t)), t))


def takes_kernel(n: int, k: int, t: int) -> bool:
    """Whether a ``t``-row step through an [n, k] weight stays on the few-row kernel (``MAX_PROGRAMS``)."""
    return k <= MAX_K and _programs_ok(triton.cdiv(n, block_n(n, k, t)), t)


def fused_argmax(x, weight, prologue: Prologue = NONE, norm_weight=None, eps: float = 0.0, scale=None, ids=None,
                 block: int | None = None, num_warps: int = 4, out=None):
    """x [T, K] -> argmax over ``fused_linear(x, weight, None, prologue, ...)``'s outputs per row [T] int64 (with
    ``ids`` [N]: ``ids`` at that index), ties to the lowest index: a draft step's output layer and its argmax in
    two kernels, the projection writing each program's best output instead of the logits, ``argmax_pick``
    choosing among them (into ``out`` [T] when given). Elsewhere: ``argmax_lastdim`` over ``fused_linear``."""
    if _fusable(x, weight, None, None, norm_weight, None):
        t, (n, k) = x.shape[0], weight.shape
        bn = block or block_n(n, k, t)
        chunks = triton.cdiv(n, bn)
        if _programs_ok(chunks, t) and pick_fits(chunks):
            part_v = torch.empty(t, chunks, dtype=torch.float32, device=x.device)
            part_i = torch.empty(t, chunks, dtype=torch.int64, device=x.device)
            if _launch(x, weight, None, prologue, None, norm_weight, eps, None, scale, part_v, None, (part_v, part_i),
                       bn, num_warps):
                return argmax_pick(part_v, part_i, ids, out)
    logits = fused_linear(x, weight, None, prologue, None, norm_weight, eps, block=block, num_warps=num_warps,
                          scale=scale)[0]
    return argmax_lastdim(logits, ids)


def _fusable(x, weight, *rows) -> bool:
    return (gemv_enabled(x, weight.shape[1]) and weight.stride(1) == 1
            and all(a is None or a.stride(-1) == 1 for a in rows))


def _programs_ok(programs_per_row: int, t: int) -> bool:
    """Whether a step of ``t`` rows stays on these kernels (``MAX_PROGRAMS``; one row always does)."""
    return t == 1 or programs_per_row * t <= MAX_PROGRAMS


def _launch(x, weight, bias, prologue, residual, norm_weight, eps, add, scale, out, res_out, parts, bn, num_warps,
            out2=None, merge=None):
    """One ``_gemv_kernel`` launch; False where it did not build here (first launch; never inside a capture).
    ``out2`` = (tensor [T, N], weight [N]): also store the outputs times that weight. ``merge``: the
    ``AttnPartials`` an ATTN_MERGE prologue reads."""
    (t, _), (n, k) = x.shape, weight.shape
    k1, k2 = k_blocks(k)
    hn = residual.shape[-1] if prologue == SILU_MUL_RSTD else 1  # the stream's width (its 1 / rms)
    m = merge  # ATTN_MERGE's partial sums and their layout (unused placeholders otherwise)
    margs = (m.acc, m.ml, m.flat_index, m.qw, m.n_qt) if m is not None else (out, out, out, 1, 1)
    mconst = dict(MG=1, MQPT=1, MBM=1, MHD=1, MNS=1, MD=1, MHKV=1) if m is None else dict(
        MG=m.g, MQPT=m.qpt, MBM=m.block_m, MHD=m.head_d, MNS=m.num_splits, MD=m.out.shape[2], MHKV=m.acc.shape[1])
    try:
        _gemv_kernel[(triton.cdiv(n, bn), t)](
            x, residual if residual is not None else x, res_out if res_out is not None else out,
            norm_weight if norm_weight is not None else weight, weight, bias if bias is not None else weight,
            add if add is not None else out, out, t, n, eps, x.stride(0),
            residual.stride(0) if residual is not None else 0, add.stride(0) if add is not None else 0,
            scale if scale is not None else out, weight.stride(0), *(parts or (out, out)), *(out2 or (out, out)),
            *margs, **mconst, K=k,
            PROLOGUE=int(prologue), HAS_BIAS=bias is not None, HAS_ADD=add is not None, HAS_SCALE=scale is not None,
            BLOCK_N=bn, K1=k1, K2=k2, ARGMAX=parts is not None, HAS_OUT2=out2 is not None, HN=hn,
            HNP=triton.next_power_of_2(hn), num_warps=num_warps, **kernel_args(x))
    except Exception as e:
        kernel_failed("gemv_merge" if merge is not None else "gemv", e)
        return False
    return True


if HAVE_TRITON:
    @triton.jit
    def _gemv_kernel(X, RES, RES_OUT, NW, W, BIAS, ADD, OUT, T, N, eps, s_x, s_r, s_a, SCALE, s_w, PV, PI, OUT2, NW2,
                     PACC, PML, FIDX, m_qw, m_nqt, MG: tl.constexpr, MQPT: tl.constexpr, MBM: tl.constexpr,
                     MHD: tl.constexpr, MNS: tl.constexpr, MD: tl.constexpr, MHKV: tl.constexpr, K: tl.constexpr,
                     PROLOGUE: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_ADD: tl.constexpr,
                     HAS_SCALE: tl.constexpr, BLOCK_N: tl.constexpr, K1: tl.constexpr, K2: tl.constexpr,
                     ARGMAX: tl.constexpr, HAS_OUT2: tl.constexpr, HN: tl.constexpr, HNP: tl.constexpr,
                     PDL: tl.constexpr):
        """K is loaded as one block of K1 columns, or (K2 > 0) as two, K1 + K2, both powers of two. ARGMAX: each
        program also writes the largest of its outputs (as rounded) and its column to PV / PI [T, programs].
        HAS_OUT2: the outputs times NW2 [N] also go to OUT2 [T, N]. HN (HNP: its power of two): the width of
        RES, the stream, for SILU_MUL_RSTD. ATTN_MERGE: row t's input is the merge of an attention step's split
        partial sums (PACC, PML, FIDX, m_*, M*: ``AttnPartials``); X only gives the dtype. PDL: only the weights
        are loaded before the predecessor kernel completes."""
        pdl_begin(PDL)
        pid = tl.program_id(0)
        t = tl.program_id(1).to(tl.int64)  # the token row
        cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)  # output features of this program
        nm = cols < N
        if PROLOGUE == 6:  # ATTN_MERGE
            w1, w2 = _gemv_weights(W, cols, nm, s_w, K, K1, K2)
            pdl_wait(PDL)
            a1, a2 = _merge_prologue(X, PACC, PML, FIDX, t, m_qw, m_nqt, MG, MQPT, MBM, MHD, MNS, MD, MHKV, K, K1, K2)
            acc = _gemv_dot(w1, w2, a1, a2, K2)
        else:
            acc = _gemv_acc(X, RES, RES_OUT, NW, W, SCALE, t, cols, nm, eps, s_x, s_r, s_w, pid, K, PROLOGUE,
                            HAS_SCALE, K1, K2, HN, HNP, PDL)  # [BLOCK_N]
        if HAS_BIAS:
            acc += tl.load(BIAS + cols, mask=nm, other=0.0).to(tl.float32)
        if HAS_ADD:
            acc += tl.load(ADD + t * s_a + cols, mask=nm, other=0.0).to(tl.float32)
        out = acc.to(X.dtype.element_ty)  # the outputs' dtype
        if not ARGMAX:
            tl.store(OUT + t * N + cols, out, mask=nm)
            if HAS_OUT2:
                nw2 = tl.load(NW2 + cols, mask=nm, other=0.0)
                tl.store(OUT2 + t * N + cols, (nw2.to(tl.float32) * out.to(tl.float32)).to(out.dtype), mask=nm)
        else:  # ties go to the lowest column, as torch.argmax's
            best, at = tl.max(tl.where(nm, out.to(tl.float32), float("-inf")), axis=0, return_indices=True,
                              return_indices_tie_break_left=True)
            tl.store(PV + t * tl.num_programs(0) + pid, best)
            tl.store(PI + t * tl.num_programs(0) + pid, (pid * BLOCK_N + at).to(tl.int64))

    @triton.jit
    def _gemv_acc(X, RES, RES_OUT, NW, W, SCALE, t, cols, nm, eps, s_x, s_r, s_w, pid, K: tl.constexpr,
                  PROLOGUE: tl.constexpr, HAS_SCALE: tl.constexpr, K1: tl.constexpr, K2: tl.constexpr,
                  HN: tl.constexpr, HNP: tl.constexpr, PDL: tl.constexpr):
        """prologue(row t of X) . W[cols] (* SCALE[cols]) in float32 [len(cols)]. The weight loads are issued
        before the prologue (whose reductions wait on barriers), so their latency overlaps it (and, with PDL,
        the predecessor kernel's tail); on the H200 a step timed the same or slightly shorter than with them
        issued after it."""
        w1, w2 = _gemv_weights(W, cols, nm, s_w, K, K1, K2)
        pdl_wait(PDL)
        a1, a2 = _gemv_prologue(X, RES, RES_OUT, NW, t, eps, s_x, s_r, pid, K, PROLOGUE, K1, K2, HN, HNP)
        acc = _gemv_dot(w1, w2, a1, a2, K2)
        if HAS_SCALE:
            acc *= tl.load(SCALE + cols, mask=nm, other=1.0).to(tl.float32)
        return acc

    @triton.jit
    def _gemv_weights(W, cols, nm, s_w, K: tl.constexpr, K1: tl.constexpr, K2: tl.constexpr):
        """Rows ``cols`` of W as loaded: ([len(cols), K1], [len(cols), K2]); the second is the first again when
        K2 = 0 (unused)."""
        w_rows = W + cols[:, None].to(tl.int64) * s_w
        ks1 = tl.arange(0, K1)
        w1 = tl.load(w_rows + ks1[None, :], mask=nm[:, None] & (ks1 < K)[None, :], other=0.0)
        w2 = w1
        if K2 > 0:
            ks2 = K1 + tl.arange(0, K2)
            w2 = tl.load(w_rows + ks2[None, :], mask=nm[:, None] & (ks2 < K)[None, :], other=0.0)
        return w1, w2

    @triton.jit
    def _gemv_prologue(X, RES, RES_OUT, NW, t, eps, s_x, s_r, pid, K: tl.constexpr, PROLOGUE: tl.constexpr,
                       K1: tl.constexpr, K2: tl.constexpr, HN: tl.constexpr, HNP: tl.constexpr):
        """Row t's input after the prologue, in float32: ([K1], [K2]) (the second is the first when K2 = 0)."""
        row, res, res_out = X + t * s_x, RES + t * s_r, RES_OUT + t * K
        rstd = 1.0
        if PROLOGUE == 5:  # SILU_MUL_RSTD: 1 / rms of the stream row (RES, HN wide)
            hs = tl.arange(0, HNP)
            sv = tl.load(res + hs, mask=hs < HN, other=0.0).to(tl.float32)
            rstd = 1.0 / tl.sqrt(tl.sum(sv * sv, axis=0) / HN + eps)
        ks1 = tl.arange(0, K1)
        km1 = ks1 < K
        x1 = _gemv_input(row, res, res_out, ks1, km1, pid, K, PROLOGUE, rstd)  # [K1]
        x2 = x1
        if K2 > 0:
            ks2 = K1 + tl.arange(0, K2)
            km2 = ks2 < K
            x2 = _gemv_input(row, res, res_out, ks2, km2, pid, K, PROLOGUE, rstd)  # [K2]
        if PROLOGUE == 1 or PROLOGUE == 2:  # RMSNorm over the whole row
            ss = tl.sum(x1.to(tl.float32) * x1.to(tl.float32), axis=0)
            if K2 > 0:
                ss += tl.sum(x2.to(tl.float32) * x2.to(tl.float32), axis=0)
            rstd = 1.0 / tl.sqrt(ss / K + eps)
            a1 = _gemv_normed(x1, NW, ks1, km1, rstd)
            a2 = a1
            if K2 > 0:
                a2 = _gemv_normed(x2, NW, ks2, km2, rstd)
        else:
            a1 = x1.to(tl.float32)
            a2 = x2.to(tl.float32)
        return a1, a2

    @triton.jit
    def _merge_prologue(X, PACC, PML, FIDX, t, qw, nqt, G: tl.constexpr, QPT: tl.constexpr, BM: tl.constexpr,
                        HD: tl.constexpr, NS: tl.constexpr, D: tl.constexpr, HKV: tl.constexpr, K: tl.constexpr,
                        K1: tl.constexpr, K2: tl.constexpr):
        """Row t's attention output, merged from its splits, rounded to X's dtype, in float32: ([K1], [K2])."""
        fi = tl.load(FIDX + t)  # b * Qw + j
        tile = (fi // qw) * nqt + (fi % qw) // QPT
        row = (fi % qw) % QPT
        a1 = _merge_cols(X, PACC, PML, tile, row, tl.arange(0, K1), G, BM, HD, NS, D, HKV, K)
        a2 = a1
        if K2 > 0:
            a2 = _merge_cols(X, PACC, PML, tile, row, K1 + tl.arange(0, K2), G, BM, HD, NS, D, HKV, K)
        return a1, a2

    @triton.jit
    def _merge_cols(X, PACC, PML, tile, row, ks, G: tl.constexpr, BM: tl.constexpr, HD: tl.constexpr,
                    NS: tl.constexpr, D: tl.constexpr, HKV: tl.constexpr, K: tl.constexpr):
        """Columns ``ks`` (head hq = k // D, dim k % D) of one token's merged attention output, as the merge
        kernel computes it (every split is merged: one past the token's keys holds max -1e30 and sum 0, which
        leaves the running values as they are)."""
        km = ks < K
        hq = ks // D
        m = row * G + hq % G  # the token's row in its tile
        base0 = (tile * HKV + hq // G) * NS
        m_tot = tl.full(ks.shape, -1.0e30, dtype=tl.float32)
        l_tot = tl.zeros(ks.shape, dtype=tl.float32)
        acc = tl.zeros(ks.shape, dtype=tl.float32)
        for s in tl.static_range(NS):
            base = base0 + s
            m_s = tl.load(PML + base * (2 * BM) + m, mask=km, other=-1.0e30)
            l_s = tl.load(PML + base * (2 * BM) + BM + m, mask=km, other=0.0)
            a_s = tl.load(PACC + base * (BM * HD) + m * HD + ks % D, mask=km, other=0.0)
            m_new = tl.maximum(m_tot, m_s)
            c_old = tl.exp(m_tot - m_new)
            c_s = tl.exp(m_s - m_new)
            l_tot = l_tot * c_old + l_s * c_s
            acc = acc * c_old + a_s * c_s
            m_tot = m_new
        out = acc / tl.where(l_tot > 0, l_tot, 1.0)
        return out.to(X.dtype.element_ty).to(tl.float32)

    @triton.jit
    def _gemv_dot(w1, w2, a1, a2, K2: tl.constexpr):
        acc = tl.sum(w1.to(tl.float32) * a1[None, :], axis=1)
        if K2 > 0:
            acc += tl.sum(w2.to(tl.float32) * a2[None, :], axis=1)
        return acc

    @triton.jit
    def _gemv_input(row, res, res_out, ks, km, pid, K: tl.constexpr, PROLOGUE: tl.constexpr, rstd):
        """Columns ``ks`` of a row's input: SiLU(gate) * up in float32 (rounded as ``silu_and_mul_ref``; SILU_MUL_RSTD:
        gate and up times ``rstd`` first, each rounded to the input dtype), or x (+ residual, stored once per row by
        the first program) in the input dtype."""
        if PROLOGUE == 3 or PROLOGUE == 5:
            x = _silu_mul_input(row, ks, km, K, rstd, PROLOGUE == 5)
        else:
            x = tl.load(row + ks, mask=km, other=0.0)
            if PROLOGUE == 2:
                x = x + tl.load(res + ks, mask=km, other=0.0)  # rounded to the stream's dtype
                if pid == 0:
                    tl.store(res_out + ks, x, mask=km)
        return x

    @triton.jit
    def _silu_mul_input(row, ks, km, K: tl.constexpr, rstd, SCALED: tl.constexpr):
        """SiLU(gate) rounded to the input dtype, times up (in that dtype), in float32."""
        g = tl.load(row + ks, mask=km, other=0.0)
        u = tl.load(row + K + ks, mask=km, other=0.0)
        if SCALED:
            g = (g.to(tl.float32) * rstd).to(u.dtype)
            u = (u.to(tl.float32) * rstd).to(u.dtype)
        g = g.to(tl.float32)
        return ((g / (1.0 + tl.exp(-g))).to(u.dtype) * u).to(tl.float32)

    @triton.jit
    def _gemv_normed(x, NW, ks, km, rstd):
        """norm weight * (x * rstd), rounded as ``rms_norm_ref`` (to x's dtype twice), in float32."""
        nw = tl.load(NW + ks, mask=km, other=0.0).to(tl.float32)
        return (nw * (x.to(tl.float32) * rstd).to(x.dtype).to(tl.float32)).to(x.dtype).to(tl.float32)
