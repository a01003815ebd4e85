"""RMSNorm with the residual add fused in: one kernel instead of ~8 small ones per call."""

from __future__ import annotations

import torch

from specserve.kernels import use_triton
from specserve.kernels.pdl import kernel_args

from specserve.kernels._triton import HAVE_TRITON, tl, triton

if HAVE_TRITON:
    from specserve.kernels.pdl import pdl_begin, pdl_wait


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None):
    """x [N, H] (any leading dims) -> normed x; with ``residual``: (normed(x + residual), x + residual)."""
    if residual is not None:
        residual = x + residual
        x = residual
    dtype = x.dtype
    x32 = x.float()
    out = weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
    return out if residual is None else (out, residual)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    if not use_triton(x) or x.shape[-1] > 16384:
        return rms_norm_ref(x, weight, eps, residual)
    h = x.shape[-1]
    x2 = x.reshape(-1, h)
    n = x2.shape[0]
    out = torch.empty_like(x2, dtype=torch.promote_types(x.dtype, weight.dtype))
    res_out = torch.empty_like(x2) if residual is not None else x2
    res_in = residual.reshape(-1, h) if residual is not None else x2
    if n:
        _rms_norm_kernel[(n,)](x2, res_in, res_out, weight, out, h, eps, x2.stride(0), res_in.stride(0),
                               HAS_RES=residual is not None, BLOCK=triton.next_power_of_2(h), **kernel_args(x))
    out = out.view(x.shape)
    return out if residual is None else (out, res_out.view(x.shape))


def embed_norm_cat(ids: torch.Tensor, table: torch.Tensor, w_embed: torch.Tensor, hidden: torch.Tensor,
                   w_hidden: torch.Tensor, eps: float) -> torch.Tensor:
    """A draft head's input: ids [...]; table [V, H]; hidden [..., H] -> cat(norm(table[ids]), norm(hidden))
    [..., 2H]. One kernel on CUDA where PyTorch takes four (embedding, two norms, cat), once per draft step."""
    h = table.shape[-1]
    if not use_triton(hidden) or h > 16384:
        return torch.cat((rms_norm_ref(table[ids], w_embed, eps), rms_norm_ref(hidden, w_hidden, eps)), dim=-1)
    ids1 = ids.reshape(-1)
    hid = hidden.reshape(-1, h)
    n = ids1.shape[0]
    out = torch.empty(n, 2 * h, dtype=torch.promote_types(hidden.dtype, w_hidden.dtype), device=hidden.device)
    if n:
        _embed_norm_cat_kernel[(n, 2)](ids1, table, w_embed, hid, w_hidden, out, h, eps, table.stride(0),
                                       hid.stride(0), BLOCK=triton.next_power_of_2(h), **kernel_args(hid))
    return out.view(*hidden.shape[:-1], 2 * h)


if HAVE_TRITON:
    @triton.jit
    def _norm_row(x, W, OUT, H, eps, cols, m):
        """Store W * rmsnorm(x) at OUT (the rounding of ``rms_norm_ref``)."""
        x32 = x.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x32 * x32, axis=0) / H + eps)
        normed = (x32 * rstd).to(x.dtype)
        w = tl.load(W + cols, mask=m, other=0.0)
        tl.store(OUT + cols, (w.to(tl.float32) * normed.to(tl.float32)).to(OUT.dtype.element_ty), mask=m)

    @triton.jit
    def _embed_norm_cat_kernel(IDS, E, WE, HID, WH, OUT, H, eps, s_e, s_h, BLOCK: tl.constexpr,
                               PDL: tl.constexpr):
        pdl_begin(PDL)
        pdl_wait(PDL)
        row = tl.program_id(0).to(tl.int64)
        half = tl.program_id(1)  # 0: the embedding half, 1: the hidden half
        cols = tl.arange(0, BLOCK)
        m = cols < H
        if half == 0:
            tok = tl.load(IDS + row).to(tl.int64)
            x = tl.load(E + tok * s_e + cols, mask=m, other=0.0)
            _norm_row(x, WE, OUT + row * 2 * H, H, eps, cols, m)
        else:
            x = tl.load(HID + row * s_h + cols, mask=m, other=0.0)
            _norm_row(x, WH, OUT + row * 2 * H + H, H, eps, cols, m)

    @triton.jit
    def _rms_norm_kernel(X, RES, RES_OUT, W, OUT, H, eps, stride_x, stride_r,
                         HAS_RES: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
        pdl_begin(PDL)
        pdl_wait(PDL)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        m = cols < H
        x = tl.load(X + row * stride_x + cols, mask=m, other=0.0)
        if HAS_RES:
            x = x + tl.load(RES + row * stride_r + cols, mask=m, other=0.0)  # rounded to the stream's dtype
            tl.store(RES_OUT + row * H + cols, x, mask=m)
        x32 = x.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x32 * x32, axis=0) / H + eps)
        normed = (x32 * rstd).to(X.dtype.element_ty)
        w = tl.load(W + cols, mask=m, other=0.0)
        tl.store(OUT + row * H + cols, (w.to(tl.float32) * normed.to(tl.float32)).to(OUT.dtype.element_ty), mask=m)
