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

No norm or activation prologue: the projections this serves are a verify step's gate/up with the norm before
it folded into its neighbours (``SwiGLU.norm_folds``), and the o projection before it, which may merge an
attention step's split partial sums in its prologue (as ``gemv.merged_linear``) and adds the stream and writes
it times the next norm's weight in its epilogue (as ``gemv.linear_add_scaled``). ``SPECSERVE_GEMV_ROWS`` =
``FORM[,BLOCK_N[,WARPS]]`` turns it on for gate/up, ``SPECSERVE_GEMV_ROWS_O`` (same spelling) for the o
projection (0: off, the default until measured faster).
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

from specserve.kernels import kernel_failed, kernel_usable
from specserve.kernels.gemv import MAX_ROWS, MERGE_MAX_SPLITS, gemv_enabled, k_blocks
from specserve.kernels.pdl import kernel_args

try:
    import triton
    import triton.language as tl

    from specserve.kernels.gemv import _gemv_dot, _gemv_weights, _merge_cols
    from specserve.kernels.pdl import pdl_begin, pdl_wait
except ImportError:
    triton = None

FORMS = {"turn": 0, "dot": 1, "bcast": 2}
# the default launch per form: (features per program, warps)
LAUNCH = {"turn": (16, 4), "dot": (16, 4), "bcast": (4, 8)}
DEFAULT = "0"  # gate/up: off until measured faster
DEFAULT_O = "0"  # the o projection: off until measured faster


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


def rows_takes(x: torch.Tensor, weight: torch.Tensor, o: bool = False) -> bool:
    """Whether the step x [T, K] through ``weight`` [N, K] runs on this kernel (``o``: as the o projection):
    on, a step of 2 to ``MAX_ROWS`` rows that the few-row kernels take, a plain weight."""
    return (setting(o) is not None and 1 < x.shape[0] <= MAX_ROWS and gemv_enabled(x, weight.shape[1])
            and weight.stride(1) == 1 and weight.dtype == x.dtype and kernel_usable("gemv_rows"))


def rows_linear(x: torch.Tensor, weight: torch.Tensor, form: str | None = None, block: int | None = None,
                num_warps: int | None = None) -> torch.Tensor:
    """x [T, K] -> x @ weight.T [T, N]: this kernel where ``rows_takes`` (or ``form`` is given: benchmarks,
    tests), ``F.linear`` elsewhere."""
    if form is None and not rows_takes(x, weight):
        return F.linear(x, weight)
    out = rows_projection(x, weight, form=form, block=block, num_warps=num_warps)
    return F.linear(x, weight) if out is None else out[0]


def rows_projection(x: torch.Tensor, weight: torch.Tensor, bias=None, add=None, norm_weight=None, merge=None,
                    o: bool = False, form: str | None = None, block: int | None = None,
                    num_warps: int | None = None):
    """x [T, K] -> (x @ W.T + b (+ add) [T, N], that times ``norm_weight`` [N] or None), rounded as
    ``gemv.linear_add_scaled`` rounds; ``merge`` (``AttnPartials``, whose ``out`` x is then a view of): the
    rows are the merge of its split partial sums, as ``gemv.merged_linear`` computes them. The launch is the
    setting's (``o``: the o projection's) unless ``form`` is given. None where the kernel does not run here (the
    caller runs its own path)."""
    if form is None:
        form, bn, warps = setting(o)
    else:
        bn, warps = LAUNCH[form]
    bn, warps = block or bn, num_warps or warps
    if merge is not None and (merge.flat_index is None or merge.num_splits > MERGE_MAX_SPLITS):
        return None
    t, (n, k) = x.shape[0], weight.shape
    k1, k2 = k_blocks(k)
    if form == "dot" and 0 < k2 < 16:  # tl.dot's K is at least 16: one block
        k1, k2 = triton.next_power_of_2(k), 0
    out = torch.empty(t, n, dtype=x.dtype, device=x.device)
    out2 = None if norm_weight is None else torch.empty(t, n, dtype=x.dtype, device=x.device)
    m = merge
    margs = (m.acc, m.ml, m.flat_index, m.qw, m.n_qt) if m is not None else (out, out, out, 1, 1)
    mconst = dict(MG=1, MQPT=1, MBM=1, MHD=1, MNS=1, MD=1, MHKV=1) if m is None else dict(
        MG=m.g, MQPT=m.qpt, MBM=m.block_m, MHD=m.head_d, MNS=m.num_splits, MD=m.out.shape[2], MHKV=m.acc.shape[1])
    try:
        _rows_kernel[(triton.cdiv(n, bn),)](
            x, weight, out, bias if bias is not None else weight, add if add is not None else out,
            out2 if out2 is not None else out, norm_weight if norm_weight is not None else weight, *margs,
            n, x.stride(0), weight.stride(0), add.stride(0) if add is not None else 0, **mconst, T=t,
            TP=triton.next_power_of_2(t) if form == "bcast" else max(16, triton.next_power_of_2(t)),
            K=k, K1=k1, K2=k2, BLOCK_N=bn, FORM=FORMS[form], PREC="ieee" if x.dtype == torch.float32 else "tf32",
            HAS_BIAS=bias is not None, HAS_ADD=add is not None, HAS_OUT2=out2 is not None, MERGE=m is not None,
            num_warps=warps, **kernel_args(x))
    except Exception as e:
        kernel_failed("gemv_rows", e)
        return None
    return out, out2


if triton is not None:
    @triton.jit
    def _rows_kernel(X, W, OUT, BIAS, ADD, OUT2, NW2, PACC, PML, FIDX, m_qw, m_nqt, N, s_x, s_w, s_a,
                     MG: tl.constexpr, MQPT: tl.constexpr, MBM: tl.constexpr, MHD: tl.constexpr, MNS: tl.constexpr,
                     MD: tl.constexpr, MHKV: tl.constexpr, T: tl.constexpr, TP: tl.constexpr, K: tl.constexpr,
                     K1: tl.constexpr, K2: tl.constexpr, BLOCK_N: tl.constexpr, FORM: tl.constexpr,
                     PREC: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_ADD: tl.constexpr, HAS_OUT2: tl.constexpr,
                     MERGE: tl.constexpr, PDL: tl.constexpr):
        """OUT[t, cols] = X[t] . W[cols] (+ BIAS[cols] + ADD[t, cols]) for the T rows, OUT2 = OUT * NW2[cols]
        (HAS_OUT2); MERGE: row t of X is the merge of an attention step's partial sums (PACC, PML, FIDX, m_*,
        M*: ``AttnPartials``), X only giving the dtype. TP: the rows as padded for ``dot`` and ``bcast``; PREC:
        ``tl.dot``'s input precision, used for float32 only. Weights, bias and NW2 are loaded before the
        predecessor completes."""
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
                t = tl.full([], r, tl.int32)
                a1, a2 = _rows_input(X, PACC, PML, FIDX, m_qw, m_nqt, t, ks1, ks2, s_x, T, MG, MQPT, MBM, MHD, MNS,
                                     MD, MHKV, K, K2, MERGE)
                acc = _gemv_dot(w1, w2, a1.to(tl.float32), a2.to(tl.float32), K2)  # [BLOCK_N]
                _rows_store(OUT, ADD, OUT2, t, cols, nm, acc, bias, nw2, N, s_a, HAS_ADD, HAS_OUT2)
        else:
            rows = tl.arange(0, TP)[:, None]  # [TP, 1]
            x1, x2 = _rows_input(X, PACC, PML, FIDX, m_qw, m_nqt, rows, ks1[None, :], ks2[None, :], s_x, T, MG, MQPT,
                                 MBM, MHD, MNS, MD, MHKV, K, K2, MERGE)  # [TP, K1], [TP, K2]
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
    def _rows_input(X, PACC, PML, FIDX, qw, nqt, t, ks1, ks2, s_x, T: tl.constexpr, G: tl.constexpr,
                    QPT: tl.constexpr, BM: tl.constexpr, HD: tl.constexpr, NS: tl.constexpr, D: tl.constexpr,
                    HKV: tl.constexpr, K: tl.constexpr, K2: tl.constexpr, MERGE: tl.constexpr):
        """Rows t (a row, or [TP, 1] rows with columns [1, K*]) of the input in X's dtype at columns ks1 and ks2
        (the second is the first when K2 = 0); rows past T read as zeros (merged: as row 0)."""
        x1 = _rows_cols(X, PACC, PML, FIDX, qw, nqt, t, ks1, s_x, T, G, QPT, BM, HD, NS, D, HKV, K, MERGE)
        x2 = x1
        if K2 > 0:
            x2 = _rows_cols(X, PACC, PML, FIDX, qw, nqt, t, ks2, s_x, T, G, QPT, BM, HD, NS, D, HKV, K, MERGE)
        return x1, x2

    @triton.jit
    def _rows_cols(X, PACC, PML, FIDX, qw, nqt, t, ks, s_x, T: tl.constexpr, G: tl.constexpr, QPT: tl.constexpr,
                   BM: tl.constexpr, HD: tl.constexpr, NS: tl.constexpr, D: tl.constexpr, HKV: tl.constexpr,
                   K: tl.constexpr, MERGE: tl.constexpr):
        if MERGE:  # as gemv's ATTN_MERGE prologue (the merge rounded to X's dtype)
            fi = tl.load(FIDX + t, mask=t < T, other=0)  # b * Qw + j
            tile = (fi // qw) * nqt + (fi % qw) // QPT
            row = (fi % qw) % QPT
            x = _merge_cols(X, PACC, PML, tile, row, ks, G, BM, HD, NS, D, HKV, K).to(X.dtype.element_ty)
        else:
            x = tl.load(X + t * s_x + ks, mask=(t < T) & (ks < K), other=0.0)
        return x

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
