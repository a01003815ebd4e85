"""A several-row step's projection with each weight block read once for all of the step's rows.

The few-row kernel (``gemv.py``) gives each program one token row: a verify step of 1 + D rows reads every
weight block 1 + D times, from L2 after the first. On the H200 that is what a verify step's gate/up projection
of the default model cost over a decode step's (6.5 against 3.0 µs: 17.7 MB through L2 instead of 3.5 MB,
in 960 programs; docs/BENCHMARKS.md, twentieth session). Here a program owns a block of output features and
every row: it loads its weight rows once (whole, as ``gemv`` does: one block of K or two power-of-two blocks)
and then forms the rows' dot products in one of these ways (``FORMS``):

* ``dot`` (the default): one ``tl.dot`` of the rows (padded to 16) by the block's weights, float32
  accumulation (tensor cores in bfloat16 / float16; float32 inputs in IEEE precision);
* ``turn``: row after row, each as the one-row kernel forms it (products in float32, summed across the block);
* ``bcast``: all rows at once as a [rows, features, K] product summed over K.

H200, 5 rows, the default model's gate/up (``benchmarks/bench_rows.py``, twenty-first session): ``dot`` with 32
features per program and 2 warps 2.21 µs a call, against 6.67 for one program per row with the norm in its
prologue (5.50 without), cuBLAS 4.28, ``turn`` 4.67 at best, ``bcast`` 8.31 at best.

No activation prologue: the projections this serves are a verify step's gate/up with the norm before
it folded into its neighbours (``SwiGLU.norm_folds``), and, off by default, the o projection before it, which
then adds the stream and writes it times the next norm's weight in its epilogue (as ``gemv.linear_add_scaled``;
a step whose attention split its keys keeps ``gemv.merged_linear``: merging a [16, K] tile of rows in a ``dot``
program spilled its registers, a verify step of 13.6 ms). ``SPECSERVE_GEMV_ROWS`` = ``FORM[,BLOCK_N[,WARPS]]``
sets the gate/up launch (0: off), ``SPECSERVE_GEMV_ROWS_O`` (same spelling) the o projection's.
``SPECSERVE_GEMV_ROWS_NORM=1`` (off) gives gate/up the residual add and RMSNorm in its prologue instead, as
``gemv``'s ADD_NORM, so that nothing folds: measured slower (a [16, K] tile normed in registers before the
``dot``: 3.6-3.8 µs a call against 2.3, a verify layer 22.2 against 19.1 µs). The qkv + RoPE kernel of several
rows (``qkv_rope._qkv_rows_kernel``) takes that prologue, its own cost being the reason it exists.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

from specserve.kernels import kernel_failed, kernel_usable
from specserve.kernels.gemv import MAX_ROWS, gemv_enabled, k_blocks
from specserve.kernels.pdl import kernel_args

from specserve.kernels._triton import HAVE_TRITON, tl, triton

if HAVE_TRITON:
    from specserve.kernels.gemv import _gemv_dot, _gemv_normed, _gemv_prologue, _gemv_weights
    from specserve.kernels.pdl import pdl_begin, pdl_wait

FORMS = {"turn": 0, "dot": 1, "bcast": 2}
# the default launch per form: (features per program, warps)
LAUNCH = {"turn": (16, 4), "dot": (16, 4), "bcast": (4, 8)}
DEFAULT = "dot,32,2"  # gate/up (bench_rows.py's best at 5 rows; whole HumanEval, docs/BENCHMARKS.md)
DEFAULT_O = "0"  # the o projection: off (faster per call without an epilogue, not measured in a step)
# Steps of fewer rows keep one program per row: at 2 rows that kernel with its norm prologue costs 3.9 µs against
# 2.2 here, about what folding the norm adds to the o and down projections (~1.8 µs at 5 rows)
MIN_ROWS = 4
# Elements of its weight block and the rows' tile ([BLOCK_N + 16, K padded]) a ``dot`` program holds per thread:
# 432 is the default model's gate/up launch (32 features x 576 at 2 warps: for sm_90 255 registers and 88 bytes
# spilled a thread, the launch measured on the GPU); at K = 960 (1,024 padded) it spilled 5.7 KB a thread and at
# 2,048 16.8 KB (``benchmarks/kernel_spills.py``), so steps that wide keep the one-row kernel or cuBLAS (``fits``)
MAX_THREAD_ELEMS = 432


@functools.lru_cache(maxsize=None)
def _parse(spec: str) -> tuple[str, int, int] | None:
    if spec in ("", "0"):
        return None
    form, *rest = spec.split(",")
    if form not in FORMS:
        raise ValueError(f"SPECSERVE_GEMV_ROWS={spec!r}: the form is one of {sorted(FORMS)} (or 0: off)")
    bn, warps = LAUNCH[form]
    if rest:
        bn = int(rest[0])
    if len(rest) > 1:
        warps = int(rest[1])
    return form, bn, warps


def setting(o: bool = False) -> tuple[str, int, int] | None:
    """(form, features per program, warps) for gate/up (``o``: the o projection) from ``SPECSERVE_GEMV_ROWS``
    (``SPECSERVE_GEMV_ROWS_O``), read at each call (tests switch it), or None: off."""
    if o:
        return _parse(os.environ.get("SPECSERVE_GEMV_ROWS_O", DEFAULT_O))
    return _parse(os.environ.get("SPECSERVE_GEMV_ROWS", DEFAULT))


def dot_blocks(k: int) -> tuple[int, int]:
    """K as a ``dot`` program loads it: ``gemv.k_blocks``, or one block where the second would be narrower than
    ``tl.dot``'s 16 (k1 is then half the next power of two)."""
    k1, k2 = k_blocks(k)
    return (2 * k1, 0) if 0 < k2 < 16 else (k1, k2)


def fits(k: int, block: int, warps: int) -> bool:
    """Whether a ``dot`` program of ``block`` weight rows over K = ``k`` with ``warps`` warps holds at most
    ``MAX_THREAD_ELEMS`` elements a thread (weights and the rows' tile padded to 16)."""
    k1, k2 = dot_blocks(k)
    return (block + 16) * (k1 + k2) <= MAX_THREAD_ELEMS * 32 * warps


def rows_takes(x: torch.Tensor, weight: torch.Tensor, o: bool = False) -> bool:
    """Whether the step x [T, K] through ``weight`` [N, K] runs on this kernel (``o``: as the o projection):
    on, a step of ``MIN_ROWS`` to ``MAX_ROWS`` rows that the few-row kernels take, a plain weight, and for the
    ``dot`` form a launch that ``fits`` K."""
    spec = setting(o)
    return (spec is not None and MIN_ROWS <= x.shape[0] <= MAX_ROWS and gemv_enabled(x, weight.shape[1])
            and weight.stride(1) == 1 and weight.dtype == x.dtype and kernel_usable("gemv_rows")
            and (spec[0] != "dot" or fits(weight.shape[1], spec[1], spec[2])))


def rows_linear(x: torch.Tensor, weight: torch.Tensor, form: str | None = None, block: int | None = None,
                num_warps: int | None = None) -> torch.Tensor:
    """x [T, K] -> x @ weight.T [T, N]: this kernel where ``rows_takes`` (or ``form`` is given: benchmarks,
    tests), ``F.linear`` elsewhere."""
    if form is None and not rows_takes(x, weight):
        return F.linear(x, weight)
    out = rows_projection(x, weight, form=form, block=block, num_warps=num_warps)
    return F.linear(x, weight) if out is None else out[0]


def rows_norm() -> bool:
    """``SPECSERVE_GEMV_ROWS_NORM=1``: gate/up on this kernel takes the norm before it (and the residual add) in
    its prologue instead of folding it into the o and down projections (off: measured slower, a verify layer
    22.2 against 19.1 µs on the H200, docs/BENCHMARKS.md)."""
    return os.environ.get("SPECSERVE_GEMV_ROWS_NORM", "0") == "1"


def rows_projection(x: torch.Tensor, weight: torch.Tensor, bias=None, add=None, norm_weight=None, o: bool = False,
                    form: str | None = None, block: int | None = None, num_warps: int | None = None,
                    residual=None, norm_in=None, eps: float = 0.0):
    """x [T, K] -> (x @ W.T + b (+ add) [T, N], that times ``norm_weight`` [N] or None), rounded as
    ``gemv.linear_add_scaled`` rounds; with ``residual`` [T, K] and ``norm_in`` [K]: of RMSNorm(x + residual)
    instead, rounded as ``gemv``'s ADD_NORM prologue, and the second value is x + residual. The launch is the
    setting's (``o``: the o projection's) unless ``form`` is given. None where the kernel does not build here
    (the caller runs its own path)."""
    if form is None:
        form, bn, warps = setting(o)
    else:
        bn, warps = LAUNCH[form]
    bn, warps = block or bn, num_warps or warps
    t, (n, k) = x.shape[0], weight.shape
    k1, k2 = dot_blocks(k) if form == "dot" else k_blocks(k)
    out = torch.empty(t, n, dtype=x.dtype, device=x.device)
    out2 = None if norm_weight is None else torch.empty(t, n, dtype=x.dtype, device=x.device)
    norm = residual is not None
    res_out = torch.empty(t, k, dtype=x.dtype, device=x.device) if norm else None
    try:
        _rows_kernel[(triton.cdiv(n, bn),)](
            x, weight, out, bias if bias is not None else weight, add if add is not None else out,
            out2 if out2 is not None else out, norm_weight if norm_weight is not None else weight,
            residual if norm else x, res_out if norm else out, norm_in if norm else weight, eps,
            residual.stride(0) if norm else 0,
            n, x.stride(0), weight.stride(0), add.stride(0) if add is not None else 0, NORM_IN=norm, T=t,
            TP=triton.next_power_of_2(t) if form == "bcast" else max(16, triton.next_power_of_2(t)),
            K=k, K1=k1, K2=k2, BLOCK_N=bn, FORM=FORMS[form], PREC="ieee" if x.dtype == torch.float32 else "tf32",
            HAS_BIAS=bias is not None, HAS_ADD=add is not None, HAS_OUT2=out2 is not None, num_warps=warps,
            **kernel_args(x))
    except Exception as e:
        kernel_failed("gemv_rows", e)
        return None
    return out, res_out if norm else out2


if HAVE_TRITON:
    @triton.jit
    def _rows_kernel(X, W, OUT, BIAS, ADD, OUT2, NW2, RES, RES_OUT, NWI, eps, s_r, N, s_x, s_w, s_a,
                     NORM_IN: tl.constexpr, T: tl.constexpr, TP: tl.constexpr,
                     K: tl.constexpr, K1: tl.constexpr, K2: tl.constexpr, BLOCK_N: tl.constexpr, FORM: tl.constexpr,
                     PREC: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_ADD: tl.constexpr, HAS_OUT2: tl.constexpr,
                     PDL: tl.constexpr):
        """OUT[t, cols] = X[t] . W[cols] (+ BIAS[cols] + ADD[t, cols]) for the T rows, OUT2 = OUT * NW2[cols]
        (HAS_OUT2); NORM_IN: X[t] is RMSNorm(X[t] + RES[t]) with weight NWI (RES_OUT[t] = X[t] + RES[t], written
        by the first program). TP: the rows as padded for ``dot`` and ``bcast``; PREC: ``tl.dot``'s input
        precision, used for float32 only. Weights, bias and NW2 are loaded before the predecessor completes."""
        pdl_begin(PDL)
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        nm = cols < N
        w1, w2 = _gemv_weights(W, cols, nm, s_w, K, K1, K2)  # [BLOCK_N, K1], [BLOCK_N, K2]
        bias = tl.zeros([BLOCK_N], dtype=tl.float32)
        if HAS_BIAS:
            bias = tl.load(BIAS + cols, mask=nm, other=0.0).to(tl.float32)
        nw2 = bias
        if HAS_OUT2:
            nw2 = tl.load(NW2 + cols, mask=nm, other=0.0).to(tl.float32)
        pdl_wait(PDL)
        ks1 = tl.arange(0, K1)
        ks2 = ks1
        if K2 > 0:
            ks2 = K1 + tl.arange(0, K2)
        if FORM == 0:  # row after row
            for r in tl.static_range(T):
                if NORM_IN:  # gemv's ADD_NORM prologue
                    a1, a2 = _gemv_prologue(X, RES, RES_OUT, NWI, tl.full([], r, tl.int64), eps, s_x, s_r,
                                            tl.program_id(0), K, 2, K1, K2, 1, 1)
                else:
                    a1 = tl.load(X + r * s_x + ks1, mask=ks1 < K, other=0.0).to(tl.float32)
                    a2 = a1
                    if K2 > 0:
                        a2 = tl.load(X + r * s_x + ks2, mask=ks2 < K, other=0.0).to(tl.float32)
                acc = _gemv_dot(w1, w2, a1, a2, K2)  # [BLOCK_N]
                _rows_store(OUT, ADD, OUT2, tl.full([], r, tl.int32), cols, nm, acc, bias, nw2, N, s_a, HAS_ADD,
                            HAS_OUT2)
        else:
            rows = tl.arange(0, TP)[:, None]  # [TP, 1]; rows past T read as zeros
            x1, x2 = _rows_tile(X, rows, ks1, ks2, s_x, T, K, K2)
            if NORM_IN:
                x1, x2 = _rows_add_norm(x1, x2, RES, RES_OUT, NWI, rows, ks1, ks2, eps, s_r, T, K, K2)
            if FORM == 1:
                acc = tl.dot(x1, tl.trans(w1), input_precision=PREC)  # [TP, BLOCK_N] float32
                if K2 > 0:
                    acc = tl.dot(x2, tl.trans(w2), acc, input_precision=PREC)
            else:  # [rows, BLOCK_N, K] products
                acc = tl.sum(x1.to(tl.float32)[:, None, :] * w1.to(tl.float32)[None, :, :], axis=2)
                if K2 > 0:
                    acc += tl.sum(x2.to(tl.float32)[:, None, :] * w2.to(tl.float32)[None, :, :], axis=2)
            _rows_store(OUT, ADD, OUT2, rows, cols[None, :], (rows < T) & nm[None, :], acc, bias[None, :],
                        nw2[None, :], N, s_a, HAS_ADD, HAS_OUT2)

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

    @triton.jit
    def _rows_store(OUT, ADD, OUT2, t, cols, m, acc, bias, nw2, N, s_a, HAS_ADD: tl.constexpr,
                    HAS_OUT2: tl.constexpr):
        """The epilogue of rows t (a row, or [TP, 1]) at ``cols``: + bias (+ ADD), rounded once; OUT2 = that
        times nw2, rounded again."""
        acc += bias
        if HAS_ADD:
            acc += tl.load(ADD + t * s_a + cols, mask=m, other=0.0).to(tl.float32)
        out = acc.to(OUT.dtype.element_ty)
        tl.store(OUT + t * N + cols, out, mask=m)
        if HAS_OUT2:
            tl.store(OUT2 + t * N + cols, (nw2 * out.to(tl.float32)).to(out.dtype), mask=m)
