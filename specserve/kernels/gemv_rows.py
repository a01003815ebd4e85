"""A several-row step's gate/up projection with each weight block read once for all of the step's rows.

The few-row kernel (``gemv.py``) gives each program one token row: a verify step of 1 + D rows reads every
weight block 1 + D times, from L2 after the first. On the H200 that is what a verify step's gate/up projection
of the default model cost over a decode step's (6.5 against 3.0 µs: 17.7 MB through L2 instead of 3.5 MB,
in 960 programs). Here a program owns a block of output features and every row: it loads its weight rows once
(whole, as ``gemv`` does: one block of K or two power-of-two blocks) and forms the rows' dot products with one
``tl.dot`` of the rows (padded to 16) by the block's weights, float32 accumulation (tensor cores in bfloat16 /
float16; float32 inputs in IEEE precision).

H200, 5 rows, the default model's gate/up (``benchmarks/bench_rows.py`` at commit ed3bfd2, removed with the forms
that lost): 32 features per program and 2 warps 2.21 µs a call, against 6.67 for one program per row with the norm in its prologue (5.50 without) and cuBLAS
4.28; rows formed in turn (4.67 at best) or as one broadcast product (8.31) lost and were removed.

No prologue: the projection this serves is a verify step's gate/up with the norm before it folded into its
neighbours (``SwiGLU.norm_folds``). The residual add and norm in this kernel's prologue instead lost (a [16, K]
tile normed in registers before the ``dot``: 3.6-3.8 µs a call against 2.3, a verify layer 22.2 against 19.1 µs).
The o projection was tried on it too and not adopted: a step whose attention split its keys needs the merge in
the prologue (``gemv.merged_linear``), which spilled its registers in a ``dot`` program (a verify step of 13.6 ms),
and the other steps' gain was never measured in a whole step. The qkv + RoPE kernel of several rows
(``qkv_rope._qkv_rows_kernel``) takes the norm prologue (``_rows_add_norm``), its own cost being the reason it
exists.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specserve.kernels import kernel_failed, kernel_usable
from specserve.kernels.gemv import MAX_ROWS, gemv_enabled, k_blocks
from specserve.kernels.pdl import kernel_args

from specserve.kernels._triton import HAVE_TRITON, tl, triton

if HAVE_TRITON:
    from specserve.kernels.gemv import _gemv_normed, _gemv_weights
    from specserve.kernels.pdl import pdl_begin, pdl_wait

# The launch: 32 features per program, 2 warps (the best of bench_rows.py's sweep at 5 rows on the H200)
BLOCK_N = 32
NUM_WARPS = 2
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


def fits(k: int, block: int, warps: int) -> bool:
    """Whether a ``tl.dot`` program of ``block`` weight rows over K = ``k`` with ``warps`` warps holds at most
    ``MAX_THREAD_ELEMS`` elements a thread (weights and the rows' tile padded to 16)."""
    k1, k2 = dot_blocks(k)
    return (block + 16) * (k1 + k2) <= MAX_THREAD_ELEMS * 32 * warps


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
        return F.linear(x, weight)
    out = _rows_matmul(x, weight, block or BLOCK_N, num_warps or NUM_WARPS)
    return F.linear(x, weight) if out is None else out


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
