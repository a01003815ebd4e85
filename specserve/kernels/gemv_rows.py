"""A several-row step's gate/up projection with each weight block read once for all of the step's rows.

The few-row kernel (``gemv.py``) gives each program one token row: a verify step of 1 + D rows reads every
weight block 1 + D times, from L2 after the first. On the H200 that is what a verify step's gate/up projection
of the default model cost over a decode step's (6.5 against 3.0 µs: 17.7 MB through L2 instead of 3.5 MB,
in 960 programs). Here a program owns a block of output features and every row: it loads its weight rows once
(whole, as ``gemv`` does: one block of K or two power-of-two blocks) and forms the rows' dot products with one
``tl.dot`` of the rows (padded to 16) by the block's weights, float32 accumulation (tensor cores in bfloat16 /
float16; float32 inputs in IEEE precision).

H200, 5 rows, the default model's gate/up (``benchmarks/bench_rows.py`` at commit ed3bfd2, removed with the forms
that lost): 32 features per program and 2 warps 2.21 µs a call, against 6.67 for one program per row with the norm
in its prologue (5.50 without) and cuBLAS 4.28; rows formed in turn (4.67 at best) or as one broadcast product
(8.31) lost and were removed.

No prologue: the projection this serves is a verify step's gate/up with the norm before it folded into its
neighbours (``SwiGLU.norm_folds``). The residual add and norm in this kernel's prologue instead lost (a [16, K]
tile normed in registers before the ``dot``: 3.6-3.8 µs a call against 2.3, a verify layer 22.2 against 19.1 µs).
The o projection was tried on it too and not adopted: a step whose attention split its keys needs the merge in
the prologue (``gemv.merged_linear``), which spilled its registers in a ``dot`` program (a verify step of 13.6 ms),
and the other steps' gain was never measured in a whole step. The qkv + RoPE kernel of several rows
(``qkv_rope._qkv_rows_kernel``) takes the norm prologue (``_rows_add_norm``), its own cost being the reason it
exists.

Steps of more rows than the one-program-per-row kernels take (``gemv.MAX_ROWS``), up to ``LOOP_MAX_ROWS`` (a draft
tree's verify step: 25 tokens at 4x6x24; a chain's of 2-6 requests at D = 4; plain decoding at 9-32 rows), run
the o, gate/up and down projections on ``_rows_loop_kernel``: all rows in one program per feature block, K in
``LOOP_BLOCK_K`` steps (no whole-K block to hold), the o projection adding the stream and writing its scaled copy,
the down projection taking SiLU(gate) * up scaled by the stream's 1 / rms in its prologue and adding the stream
(``loop_linear``), so the layer's norm after attention folds away as in a verify step (``SwiGLU.norm_folds``).
Before, such a step ran cuBLAS with separate norm, RoPE and SiLU kernels: about ten kernels a layer where this path
runs five or six.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specserve.kernels import gemv, kernel_failed, kernel_usable
from specserve.kernels.gemv import MAX_ROWS, NONE, SILU_MUL_RSTD, Prologue, gemv_enabled, k_blocks
from specserve.kernels.pdl import kernel_args

from specserve.kernels._triton import HAVE_TRITON, tl, triton

if HAVE_TRITON:
    from specserve.kernels.gemv import _gemv_normed, _gemv_weights
    from specserve.kernels.pdl import pdl_begin, pdl_wait

# The launch: 32 features per program, 2 warps (the best of bench_rows.py's sweep at 5 rows on the H200)
BLOCK_N = 32
NUM_WARPS = 2
# ``_rows_loop_kernel``: steps of MAX_ROWS + 1 to LOOP_MAX_ROWS rows; K read LOOP_BLOCK_K columns at a time, with
# LOOP_WARPS warps; LOOP_BLOCK_N features per program, or half that where a projection would have fewer than
# LOOP_MIN_PROGRAMS programs (the o and down projections of the default model: 576 features)
LOOP_MAX_ROWS = 32
LOOP_BLOCK_K = 64
LOOP_BLOCK_N = 32
LOOP_MIN_PROGRAMS = 64
LOOP_WARPS = 4
# Steps of fewer rows keep one program per row: at 2 rows that kernel with its norm prologue costs 3.9 µs against
# 2.2 here, about what folding the norm adds to the o and down projections (~1.8 µs at 5 rows)
MIN_ROWS = 4
# Elements of its weight block and the rows' tile ([BLOCK_N + 16, K padded]) a program holds per thread: 432 is
# the default model's gate/up launch (32 features x 576 at 2 warps: for sm_90 255 registers and 88 bytes spilled a
# thread, the launch measured on the GPU); at K = 960 (1,024 padded) it spilled 5.7 KB a thread and at 2,048
# 16.8 KB (``benchmarks/kernel_spills.py``), so steps that wide keep the one-row kernel or cuBLAS (``fits``)
MAX_THREAD_ELEMS = 432


def dot_blocks(k: int) -> tuple[int, int]:
    """K as a ``tl.dot`` program loads it: ``gemv.k_blocks``, or one block where the second would be narrower
    than ``tl.dot``'s 16 (k1 is then half the next power of two)."""
    k1, k2 = k_blocks(k)
    return (2 * k1, 0) if 0 < k2 < 16 else (k1, k2)


def fits(k: int, block: int, warps: int, rows: int = 16) -> bool:
    """Whether a ``tl.dot`` program of ``block`` weight rows over K = ``k`` with ``warps`` warps holds at most
    ``MAX_THREAD_ELEMS`` elements a thread (weights and the rows' tile, ``rows`` padded as ``padded_rows``)."""
    k1, k2 = dot_blocks(k)
    return (block + padded_rows(rows)) * (k1 + k2) <= MAX_THREAD_ELEMS * 32 * warps


def padded_rows(t: int) -> int:
    """A step's rows as a ``tl.dot`` tile holds them: a power of two, at least 16 (``tl.dot``'s least M)."""
    return max(16, triton.next_power_of_2(t))


def rows_takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the step x [T, K] through ``weight`` [N, K] runs on this kernel: a step of ``MIN_ROWS`` to
    ``MAX_ROWS`` rows that the few-row kernels take, a plain weight, and a launch that ``fits`` K."""
    return (MIN_ROWS <= x.shape[0] <= MAX_ROWS and gemv_enabled(x, weight.shape[1]) and weight.stride(1) == 1
            and weight.dtype == x.dtype and kernel_usable("gemv_rows") and fits(weight.shape[1], BLOCK_N, NUM_WARPS))


def rows_linear(x: torch.Tensor, weight: torch.Tensor, block: int | None = None,
                num_warps: int | None = None) -> torch.Tensor:
    """x [T, K] -> x @ weight.T [T, N]: this kernel where ``rows_takes``, ``F.linear`` elsewhere. ``block`` /
    ``num_warps`` (benchmarks, tests) override the launch and skip the ``rows_takes`` check."""
    if block is None and num_warps is None and not rows_takes(x, weight):
        looped = loop_linear(x, weight) if loop_takes(x, weight) else None
        return F.linear(x, weight) if looped is None else looped[0]
    out = _rows_matmul(x, weight, block or BLOCK_N, num_warps or NUM_WARPS)
    return F.linear(x, weight) if out is None else out


def loop_takes(like: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether a step of ``like``'s rows, dtype and device through ``weight`` [N, K] runs on
    ``_rows_loop_kernel``: more rows than the one-row kernels take (``MAX_ROWS``), at most ``LOOP_MAX_ROWS``, a
    reduced width they take (``gemv.MAX_K``: a small model's), a plain weight of the rows' dtype, bfloat16 or float32
    (float16 stays off the norm fold this path is built on: ``SwiGLU.norm_folds``)."""
    return (like.dim() == 2 and MAX_ROWS < like.shape[0] <= LOOP_MAX_ROWS and like.stride(-1) == 1
            and like.dtype in (torch.float32, torch.bfloat16) and weight.dtype == like.dtype
            and weight.stride(1) == 1 and gemv._rows_enabled(like, 1, weight.shape[1])  # the few-row family's gate
            and kernel_usable("gemv_loop"))


def loop_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                prologue: Prologue = NONE, stream: torch.Tensor | None = None, eps: float = 0.0,
                add: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None):
    """x [T, K] (SILU_MUL_RSTD: [T, 2K], gate then up) -> (out = prologue(x) @ W.T + b + add [T, N], out *
    ``norm_weight`` [T, N] or None) on ``_rows_loop_kernel``, as ``gemv.linear_ref`` computes them (``add``
    before the one rounding, as ``fused_linear`` adds it; the scaled copy as ``linear_add_scaled`` rounds it).
    SILU_MUL_RSTD: gate and up first scaled by 1 / rms of ``stream`` [T, H] (with ``eps``). None where
    ``loop_takes`` does not hold or the kernel does not build here (the caller runs its other path)."""
    k = weight.shape[1]
    if prologue not in (NONE, SILU_MUL_RSTD) or (prologue == SILU_MUL_RSTD) != (stream is not None) or \
            x.shape[1] != (2 * k if prologue == SILU_MUL_RSTD else k) or not loop_takes(x, weight) or \
            any(a is not None and (a.stride(-1) != 1 or a.dtype != x.dtype) for a in (bias, stream, add, norm_weight)):
        return None
    return _loop_launch(x, weight, bias, prologue, stream, eps, add, norm_weight)


def _loop_launch(x, weight, bias, prologue, stream, eps, add, norm_weight):
    """``loop_linear``'s launch, its arguments as it checked them (the kernel checks also launch it on float16,
    which stands in for bfloat16 in Triton's interpreter)."""
    t, (n, k) = x.shape[0], weight.shape
    bn = LOOP_BLOCK_N if triton.cdiv(n, LOOP_BLOCK_N) >= LOOP_MIN_PROGRAMS else LOOP_BLOCK_N // 2
    hn = stream.shape[1] if stream is not None else 1
    out = torch.empty(t, n, dtype=x.dtype, device=x.device)
    scaled = torch.empty(t, n, dtype=x.dtype, device=x.device) if norm_weight is not None else None
    try:
        _rows_loop_kernel[(triton.cdiv(n, bn),)](
            x, stream if stream is not None else x, weight, bias if bias is not None else weight,
            add if add is not None else out, out, norm_weight if norm_weight is not None else weight,
            scaled if scaled is not None else out, n, eps, x.stride(0), stream.stride(0) if stream is not None else 0,
            add.stride(0) if add is not None else 0, weight.stride(0), T=t, TP=padded_rows(t), K=k, BLOCK_N=bn,
            BLOCK_K=LOOP_BLOCK_K, PROLOGUE=int(prologue), HN=hn, HNP=triton.next_power_of_2(hn),
            HAS_BIAS=bias is not None, HAS_ADD=add is not None, HAS_OUT2=scaled is not None,
            PREC="ieee" if x.dtype == torch.float32 else "tf32", num_warps=LOOP_WARPS, **kernel_args(x))
    except Exception as e:
        kernel_failed("gemv_loop", e)
        return None
    return out, scaled


def _rows_matmul(x: torch.Tensor, weight: torch.Tensor, bn: int, warps: int) -> torch.Tensor | None:
    """x @ weight.T on ``_rows_kernel`` with ``bn`` features per program and ``warps`` warps; None where the kernel
    does not build here (the caller runs ``F.linear``)."""
    t, (n, k) = x.shape[0], weight.shape
    k1, k2 = dot_blocks(k)
    out = torch.empty(t, n, dtype=x.dtype, device=x.device)
    try:
        _rows_kernel[(triton.cdiv(n, bn),)](
            x, weight, out, n, x.stride(0), weight.stride(0), T=t, TP=max(16, triton.next_power_of_2(t)), K=k,
            K1=k1, K2=k2, BLOCK_N=bn, PREC="ieee" if x.dtype == torch.float32 else "tf32", num_warps=warps,
            **kernel_args(x))
    except Exception as e:
        kernel_failed("gemv_rows", e)
        return None
    return out


if HAVE_TRITON:
    @triton.jit
    def _rows_kernel(X, W, OUT, N, s_x, s_w, T: tl.constexpr, TP: tl.constexpr, K: tl.constexpr, K1: tl.constexpr,
                     K2: tl.constexpr, BLOCK_N: tl.constexpr, PREC: tl.constexpr, PDL: tl.constexpr):
        """OUT[t, cols] = X[t] . W[cols] for the T rows (padded to TP for ``tl.dot``). PREC: ``tl.dot``'s input
        precision, used for float32 only. The weights are loaded before the predecessor completes."""
        pdl_begin(PDL)
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        nm = cols < N
        w1, w2 = _gemv_weights(W, cols, nm, s_w, K, K1, K2)  # [BLOCK_N, K1], [BLOCK_N, K2]
        pdl_wait(PDL)
        ks1 = tl.arange(0, K1)
        ks2 = ks1
        if K2 > 0:
            ks2 = K1 + tl.arange(0, K2)
        rows = tl.arange(0, TP)[:, None]  # [TP, 1]; rows past T read as zeros
        x1, x2 = _rows_tile(X, rows, ks1, ks2, s_x, T, K, K2)
        acc = tl.dot(x1, tl.trans(w1), input_precision=PREC)  # [TP, BLOCK_N] float32
        if K2 > 0:
            acc = tl.dot(x2, tl.trans(w2), acc, input_precision=PREC)
        tl.store(OUT + rows * N + cols[None, :], acc.to(OUT.dtype.element_ty), mask=(rows < T) & nm[None, :])

    @triton.jit
    def _rows_loop_kernel(X, RES, W, BIAS, ADD, OUT, NW2, OUT2, N, eps, s_x, s_r, s_a, s_w, T: tl.constexpr,
                          TP: tl.constexpr, K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          PROLOGUE: tl.constexpr, HN: tl.constexpr, HNP: tl.constexpr, HAS_BIAS: tl.constexpr,
                          HAS_ADD: tl.constexpr, HAS_OUT2: tl.constexpr, PREC: tl.constexpr, PDL: tl.constexpr):
        """OUT[t, cols] = prologue(X[t]) . W[cols] (+ BIAS + ADD[t]) for the T rows (padded to TP), K in BLOCK_K
        steps, one ``tl.dot`` each, float32 accumulation; HAS_OUT2: OUT2 = OUT * NW2 too. PROLOGUE 5
        (SILU_MUL_RSTD): X holds gate [T, K] then up, each scaled by the row's 1 / rms of RES [T, HN] and rounded,
        then SiLU(gate) * up rounded as ``gemv._silu_mul_input``. The block's first weights are loaded before
        the predecessor completes."""
        pdl_begin(PDL)
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        nm = cols < N
        w_rows = W + cols[:, None].to(tl.int64) * s_w  # [BLOCK_N, 1]
        kb = tl.arange(0, BLOCK_K)
        w = tl.load(w_rows + kb[None, :], mask=nm[:, None] & (kb < K)[None, :], other=0.0)  # [BLOCK_N, BLOCK_K]
        pdl_wait(PDL)
        rows = tl.arange(0, TP)[:, None]  # [TP, 1]; rows past T read as zeros and are not stored
        rm = rows < T
        rstd = tl.full([TP, 1], 1.0, dtype=tl.float32)
        if PROLOGUE == 5:
            hs = tl.arange(0, HNP)[None, :]
            sv = tl.load(RES + rows * s_r + hs, mask=rm & (hs < HN), other=0.0).to(tl.float32)  # [TP, HNP]
            rstd = 1.0 / tl.sqrt(tl.sum(sv * sv, axis=1, keep_dims=True) / HN + eps)
        acc = tl.zeros([TP, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + kb
            am = rm & (ks < K)[None, :]
            a = tl.load(X + rows * s_x + ks[None, :], mask=am, other=0.0)  # [TP, BLOCK_K]
            if PROLOGUE == 5:
                u = tl.load(X + rows * s_x + K + ks[None, :], mask=am, other=0.0)
                g = (a.to(tl.float32) * rstd).to(u.dtype).to(tl.float32)
                u = (u.to(tl.float32) * rstd).to(u.dtype)
                a = (g / (1.0 + tl.exp(-g))).to(u.dtype) * u
            acc = tl.dot(a, tl.trans(w), acc, input_precision=PREC)  # [TP, BLOCK_N]
            nk = k0 + BLOCK_K + kb  # the next block's weights (none past K)
            w = tl.load(w_rows + nk[None, :], mask=nm[:, None] & (nk < K)[None, :], other=0.0)
        if HAS_BIAS:
            acc += tl.load(BIAS + cols, mask=nm, other=0.0).to(tl.float32)[None, :]
        om = rm & nm[None, :]
        if HAS_ADD:
            acc += tl.load(ADD + rows * s_a + cols[None, :], mask=om, other=0.0).to(tl.float32)
        out = acc.to(OUT.dtype.element_ty)
        tl.store(OUT + rows * N + cols[None, :], out, mask=om)
        if HAS_OUT2:
            nw2 = tl.load(NW2 + cols, mask=nm, other=0.0).to(tl.float32)[None, :]
            tl.store(OUT2 + rows * N + cols[None, :], (nw2 * out.to(tl.float32)).to(out.dtype), mask=om)

    @triton.jit
    def _rows_tile(X, rows, ks1, ks2, s_x, T: tl.constexpr, K: tl.constexpr, K2: tl.constexpr):
        """Rows [TP, 1] of X at columns ks1 and ks2 -> [TP, K1], [TP, K2] (the second is the first when K2 = 0);
        rows past T and columns past K read as zeros."""
        x1 = tl.load(X + rows * s_x + ks1[None, :], mask=(rows < T) & (ks1 < K)[None, :], other=0.0)
        x2 = x1
        if K2 > 0:
            x2 = tl.load(X + rows * s_x + ks2[None, :], mask=(rows < T) & (ks2 < K)[None, :], other=0.0)
        return x1, x2

    @triton.jit
    def _rows_add_norm(x1, x2, RES, RES_OUT, NWI, rows, ks1, ks2, eps, s_r, T: tl.constexpr, K: tl.constexpr,
                       K2: tl.constexpr, ADD: tl.constexpr = True):
        """Rows [TP, K1] and [TP, K2] -> RMSNorm(rows + residual) in their dtype, rounded as gemv's ADD_NORM
        prologue (the sum in the rows' dtype, then ``_gemv_normed``); the sums written by the first program.
        Without ADD: the rows' norm alone, as the NORM prologue (RES and RES_OUT unused)."""
        m1 = (rows < T) & (ks1 < K)[None, :]
        if ADD:
            x1 = x1 + tl.load(RES + rows * s_r + ks1[None, :], mask=m1, other=0.0)
            if tl.program_id(0) == 0:
                tl.store(RES_OUT + rows * K + ks1[None, :], x1, mask=m1)
        ss = tl.sum(x1.to(tl.float32) * x1.to(tl.float32), axis=1, keep_dims=True)  # [TP, 1]
        if K2 > 0:
            m2 = (rows < T) & (ks2 < K)[None, :]
            if ADD:
                x2 = x2 + tl.load(RES + rows * s_r + ks2[None, :], mask=m2, other=0.0)
                if tl.program_id(0) == 0:
                    tl.store(RES_OUT + rows * K + ks2[None, :], x2, mask=m2)
            ss += tl.sum(x2.to(tl.float32) * x2.to(tl.float32), axis=1, keep_dims=True)
        rstd = 1.0 / tl.sqrt(ss / K + eps)
        n1 = _gemv_normed(x1, NWI, ks1[None, :], (ks1 < K)[None, :], rstd).to(x1.dtype)
        n2 = n1
        if K2 > 0:
            n2 = _gemv_normed(x2, NWI, ks2[None, :], (ks2 < K)[None, :], rstd).to(x2.dtype)
        return n1, n2
