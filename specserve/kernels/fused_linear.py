"""Decode-sized linear layers with their elementwise prologue fused in (experimental, off by default).

The H200 profile of the default model (docs/BENCHMARKS.md) shows a decode step as ~270 kernels of 1-4 µs each:
the device is busy with launches' fixed cost, not with bytes. Two of a Llama layer's nine kernels only prepare
the next GEMM's input, so for steps of at most ``MAX_ROWS`` tokens they can run inside it:

* ``norm_linear``: (residual add +) RMSNorm, then ``x @ W.T`` — replaces the norm kernel before the qkv and
  gate/up projections;
* ``silu_mul_linear``: SiLU(gate) * up, then ``x @ W.T`` — replaces the activation kernel before the down
  projection.

Every program of the grid owns ``BLOCK_N`` output columns and recomputes the (tiny) normalised rows; the
rounding follows the unfused kernels (normalised values and activations rounded to the input dtype before the
product), and only the GEMM's summation order differs from cuBLAS. The reduced width (K) is a compile-time
constant: a model has two or three. ``SPECSERVE_FUSED_LINEAR=1`` turns the path
on (CUDA, or the CPU under Triton's interpreter); it is kept off until the GPU measures it faster.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from specserve.kernels import use_triton
from specserve.kernels.activation import silu_and_mul_ref
from specserve.kernels.norm import rms_norm_ref

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

MAX_ROWS = 16  # tokens per step the fused path takes (one tl.dot tile of rows)
BLOCK_N, BLOCK_K = 16, 128


def fused_linear_enabled(x: torch.Tensor) -> bool:
    """Whether a step with input ``x`` [T, K] takes the fused path."""
    return (os.environ.get("SPECSERVE_FUSED_LINEAR") == "1" and use_triton(x) and x.dim() == 2
            and 0 < x.shape[0] <= MAX_ROWS and x.stride(-1) == 1
            and x.dtype in (torch.float32, torch.bfloat16, torch.float16))


def norm_linear_ref(x, residual, norm_weight, eps: float, weight, bias=None):
    """x [T, K], residual [T, K] or None -> (RMSNorm(x + residual) @ W.T + b [T, N], x + residual)."""
    if residual is None:
        return F.linear(rms_norm_ref(x, norm_weight, eps), weight, bias), x
    h, residual = rms_norm_ref(x, norm_weight, eps, residual)
    return F.linear(h, weight, bias), residual


def silu_mul_linear_ref(gate_up, weight, bias=None):
    """gate_up [T, 2I] -> (SiLU(gate) * up) @ W.T + b [T, N]."""
    return F.linear(silu_and_mul_ref(gate_up), weight, bias)


def norm_linear(x, residual, norm_weight, eps: float, weight, bias=None):
    if not fused_linear_enabled(x):
        return norm_linear_ref(x, residual, norm_weight, eps, weight, bias)
    t, k = x.shape
    n = weight.shape[0]
    out = torch.empty(t, n, dtype=x.dtype, device=x.device)
    res_out = torch.empty_like(x) if residual is not None else x
    res_in = residual if residual is not None else x
    _norm_linear_kernel[(triton.cdiv(n, BLOCK_N),)](
        x, res_in, res_out, norm_weight, weight, bias if bias is not None else weight, out, t, n, k, eps,
        x.stride(0), res_in.stride(0), weight.stride(0), HAS_RES=residual is not None, HAS_BIAS=bias is not None,
        BLOCK_M=MAX_ROWS, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, IEEE=x.dtype == torch.float32)
    return out, res_out


def silu_mul_linear(gate_up, weight, bias=None):
    if not fused_linear_enabled(gate_up):
        return silu_mul_linear_ref(gate_up, weight, bias)
    t, i2 = gate_up.shape
    n = weight.shape[0]
    out = torch.empty(t, n, dtype=gate_up.dtype, device=gate_up.device)
    _silu_mul_linear_kernel[(triton.cdiv(n, BLOCK_N),)](
        gate_up, weight, bias if bias is not None else weight, out, t, n, i2 // 2, gate_up.stride(0),
        weight.stride(0), HAS_BIAS=bias is not None, BLOCK_M=MAX_ROWS, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
        IEEE=gate_up.dtype == torch.float32)
    return out


if triton is not None:
    @triton.jit
    def _dot(a, w, IEEE: tl.constexpr):
        """a [M, K] @ w[N, K].T in float32."""
        if IEEE:
            return tl.dot(a, tl.trans(w), input_precision="ieee")
        return tl.dot(a, tl.trans(w))

    @triton.jit
    def _store_out(acc, B, OUT, rows, cols, T, N, HAS_BIAS: tl.constexpr):
        if HAS_BIAS:
            acc += tl.load(B + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
        tl.store(OUT + rows[:, None] * N + cols[None, :], acc.to(OUT.dtype.element_ty),
                 mask=(rows < T)[:, None] & (cols < N)[None, :])

    @triton.jit
    def _load_stream(X, RES, rows, ks, s_x, s_r, rm, HAS_RES: tl.constexpr):
        """Rows of x (+ residual, added in the storage dtype as the norm kernel does) for columns ks."""
        m = rm[:, None] & (ks >= 0)[None, :]
        x = tl.load(X + rows[:, None] * s_x + ks[None, :], mask=m, other=0.0)
        if HAS_RES:
            x = x + tl.load(RES + rows[:, None] * s_r + ks[None, :], mask=m, other=0.0)
        return x

    @triton.jit
    def _norm_linear_kernel(X, RES, RES_OUT, NW, W, B, OUT, T, N, K: tl.constexpr, eps, s_x, s_r, s_w,
                            HAS_RES: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
        pid = tl.program_id(0)
        rows = tl.arange(0, BLOCK_M)
        rm = rows < T
        cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        ss = tl.zeros([BLOCK_M], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):  # pass 1: each row's mean square (and the new residual, once)
            ks = k0 + tl.arange(0, BLOCK_K)
            ks = tl.where(ks < K, ks, -1)
            x = _load_stream(X, RES, rows, ks, s_x, s_r, rm, HAS_RES)
            if HAS_RES:
                if pid == 0:
                    tl.store(RES_OUT + rows[:, None] * K + ks[None, :], x, mask=rm[:, None] & (ks >= 0)[None, :])
            x32 = x.to(tl.float32)
            ss += tl.sum(x32 * x32, axis=1)
        rstd = 1.0 / tl.sqrt(ss / K + eps)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):  # pass 2: normalised rows times this program's weight rows
            ks = k0 + tl.arange(0, BLOCK_K)
            ks = tl.where(ks < K, ks, -1)
            x = _load_stream(X, RES, rows, ks, s_x, s_r, rm, HAS_RES)
            normed = (x.to(tl.float32) * rstd[:, None]).to(X.dtype.element_ty)
            nw = tl.load(NW + ks, mask=ks >= 0, other=0.0).to(tl.float32)
            a = (nw[None, :] * normed.to(tl.float32)).to(X.dtype.element_ty)
            w = tl.load(W + cols[:, None] * s_w + ks[None, :], mask=(cols < N)[:, None] & (ks >= 0)[None, :],
                        other=0.0)
            acc += _dot(a, w, IEEE)
        _store_out(acc, B, OUT, rows, cols, T, N, HAS_BIAS)

    @triton.jit
    def _silu_mul_linear_kernel(GU, W, B, OUT, T, N, I: tl.constexpr, s_g, s_w, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
        pid = tl.program_id(0)
        rows = tl.arange(0, BLOCK_M)
        rm = rows < T
        cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, I, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            km = rm[:, None] & (ks < I)[None, :]
            g = tl.load(GU + rows[:, None] * s_g + ks[None, :], mask=km, other=0.0).to(tl.float32)
            u = tl.load(GU + rows[:, None] * s_g + I + ks[None, :], mask=km, other=0.0)
            s = (g / (1.0 + tl.exp(-g))).to(GU.dtype.element_ty)  # rounded as the activation kernel does
            w = tl.load(W + cols[:, None] * s_w + ks[None, :], mask=(cols < N)[:, None] & (ks < I)[None, :],
                        other=0.0)
            acc += _dot((s * u).to(GU.dtype.element_ty), w, IEEE)
        _store_out(acc, B, OUT, rows, cols, T, N, HAS_BIAS)
