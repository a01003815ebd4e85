"""A several-row step's projection with each weight block read once for all of the step's rows.

The few-row kernel (``gemv.py``) gives each program one token row: a verify step of 1 + D rows reads every
weight block 1 + D times, from L2 after the first. On the H200 that is what a verify step's gate/up projection
of the default model costs over a decode step's (6.5 against 3.0 µs: 17.7 MB through L2 instead of 3.5 MB,
in 960 programs, more than one wave; docs/BENCHMARKS.md, twentieth session). Here a program owns a block of
output features and every row: it loads its weight rows once (whole, as ``gemv`` does: one block of K or two
power-of-two blocks) and then forms the rows' dot products in one of these ways (``FORMS``):

* ``turn``: row after row, each as the one-row kernel forms it (products in float32, summed across the block);
* ``dot``: one ``tl.dot`` of the rows (padded to 16) by the block's weights, float32 accumulation (tensor
  cores in bfloat16 / float16; float32 inputs in IEEE precision);
* ``bcast``: all rows at once as a [rows, features, K] product summed over K.

No prologue: the projection this serves is a verify step's gate/up with the norm before it folded into its
neighbours (``SwiGLU.norm_folds``). ``SPECSERVE_GEMV_ROWS`` = ``FORM[,BLOCK_N[,WARPS]]`` turns it on (0: off,
the default until measured faster).
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

from specserve.kernels import kernel_failed, kernel_usable
from specserve.kernels.gemv import MAX_ROWS, gemv_enabled, k_blocks
from specserve.kernels.pdl import kernel_args

try:
    import triton
    import triton.language as tl

    from specserve.kernels.gemv import _gemv_dot, _gemv_weights
    from specserve.kernels.pdl import pdl_begin, pdl_wait
except ImportError:
    triton = None

FORMS = {"turn": 0, "dot": 1, "bcast": 2}
# the default launch per form: (features per program, warps)
LAUNCH = {"turn": (16, 4), "dot": (16, 4), "bcast": (4, 8)}
DEFAULT = "0"  # off until measured faster


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


def setting() -> tuple[str, int, int] | None:
    """(form, features per program, warps) from ``SPECSERVE_GEMV_ROWS`` (read at each call: tests switch it),
    or None: off."""
    return _parse(os.environ.get("SPECSERVE_GEMV_ROWS", DEFAULT))


def rows_takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``rows_linear`` runs the step x [T, K] through ``weight`` [N, K] as this kernel: on, a step of
    2 to ``MAX_ROWS`` rows that the few-row kernels take, a plain weight."""
    return (setting() is not None and 1 < x.shape[0] <= MAX_ROWS and gemv_enabled(x, weight.shape[1])
            and weight.stride(1) == 1 and weight.dtype == x.dtype and kernel_usable("gemv_rows"))


def rows_linear(x: torch.Tensor, weight: torch.Tensor, form: str | None = None, block: int | None = None,
                num_warps: int | None = None) -> torch.Tensor:
    """x [T, K] -> x @ weight.T [T, N]: this kernel where ``rows_takes`` (or ``form`` is given: benchmarks,
    tests), ``F.linear`` elsewhere."""
    if form is None:
        if not rows_takes(x, weight):
            return F.linear(x, weight)
        form, bn, warps = setting()
    else:
        bn, warps = LAUNCH[form]
    bn, warps = block or bn, num_warps or warps
    t, (n, k) = x.shape[0], weight.shape
    k1, k2 = k_blocks(k)
    if form == "dot" and 0 < k2 < 16:  # tl.dot's K is at least 16: one block
        k1, k2 = triton.next_power_of_2(k), 0
    out = torch.empty(t, n, dtype=x.dtype, device=x.device)
    try:
        _rows_kernel[(triton.cdiv(n, bn),)](
            x, weight, out, n, x.stride(0), weight.stride(0), T=t,
            TP=triton.next_power_of_2(t) if form == "bcast" else max(16, triton.next_power_of_2(t)),
            K=k, K1=k1, K2=k2, BLOCK_N=bn, FORM=FORMS[form], PREC="ieee" if x.dtype == torch.float32 else "tf32",
            num_warps=warps,
            **kernel_args(x))
    except Exception as e:
        kernel_failed("gemv_rows", e)
        return F.linear(x, weight)
    return out


if triton is not None:
    @triton.jit
    def _rows_kernel(X, W, OUT, N, s_x, s_w, T: tl.constexpr, TP: tl.constexpr, K: tl.constexpr, K1: tl.constexpr,
                     K2: tl.constexpr, BLOCK_N: tl.constexpr, FORM: tl.constexpr, PREC: tl.constexpr,
                     PDL: tl.constexpr):
        """OUT[t, cols] = X[t] . W[cols] for the T rows (TP: the rows as padded for ``dot`` and ``bcast``; PREC:
        ``tl.dot``'s input precision, used for float32 only); the weights loaded before the predecessor completes."""
        pdl_begin(PDL)
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        nm = cols < N
        w1, w2 = _gemv_weights(W, cols, nm, s_w, K, K1, K2)  # [BLOCK_N, K1], [BLOCK_N, K2]
        pdl_wait(PDL)
        ks1 = tl.arange(0, K1)
        if FORM == 0:  # row after row
            for r in tl.static_range(T):
                a1 = tl.load(X + r * s_x + ks1, mask=ks1 < K, other=0.0).to(tl.float32)
                a2 = a1
                if K2 > 0:
                    ks2 = K1 + tl.arange(0, K2)
                    a2 = tl.load(X + r * s_x + ks2, mask=ks2 < K, other=0.0).to(tl.float32)
                acc = _gemv_dot(w1, w2, a1, a2, K2)  # [BLOCK_N]
                tl.store(OUT + r * N + cols, acc.to(OUT.dtype.element_ty), mask=nm)
        else:
            rows = tl.arange(0, TP)
            rm = rows < T
            x1 = tl.load(X + rows[:, None] * s_x + ks1[None, :], mask=rm[:, None] & (ks1 < K)[None, :], other=0.0)
            if FORM == 1:
                acc = tl.dot(x1, tl.trans(w1), input_precision=PREC)  # [TP, BLOCK_N] float32
                if K2 > 0:
                    ks2 = K1 + tl.arange(0, K2)
                    x2 = tl.load(X + rows[:, None] * s_x + ks2[None, :], mask=rm[:, None] & (ks2 < K)[None, :],
                                 other=0.0)
                    acc = tl.dot(x2, tl.trans(w2), acc, input_precision=PREC)
            else:  # [rows, BLOCK_N, K] products
                acc = tl.sum(x1.to(tl.float32)[:, None, :] * w1.to(tl.float32)[None, :, :], axis=2)
                if K2 > 0:
                    ks2 = K1 + tl.arange(0, K2)
                    x2 = tl.load(X + rows[:, None] * s_x + ks2[None, :], mask=rm[:, None] & (ks2 < K)[None, :],
                                 other=0.0)
                    acc += tl.sum(x2.to(tl.float32)[:, None, :] * w2.to(tl.float32)[None, :, :], axis=2)
            tl.store(OUT + rows[:, None] * N + cols[None, :], acc.to(OUT.dtype.element_ty),
                     mask=rm[:, None] & nm[None, :])
