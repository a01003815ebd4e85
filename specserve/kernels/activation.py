"""SiLU(gate) * up over the fused gate/up projection, in one kernel."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specserve.kernels import use_triton
from specserve.kernels.pdl import kernel_args

from specserve.kernels._triton import HAVE_TRITON, tl, triton

if HAVE_TRITON:
    from specserve.kernels.pdl import pdl_begin, pdl_wait


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2I] (gate, up) -> [..., I]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    if not use_triton(x):
        return silu_and_mul_ref(x)
    i = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * i)
    n = x2.shape[0]
    out = torch.empty((n, i), dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(i))
    if n:
        _silu_mul_kernel[(n, triton.cdiv(i, block))](x2, out, i, x2.stride(0), BLOCK=block, **kernel_args(x))
    return out.view(*x.shape[:-1], i)


if HAVE_TRITON:
    @triton.jit
    def _silu_mul_kernel(X, OUT, I, stride_x, BLOCK: tl.constexpr, PDL: tl.constexpr):
        pdl_begin(PDL)
        pdl_wait(PDL)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = cols < I
        g = tl.load(X + row * stride_x + cols, mask=m, other=0.0).to(tl.float32)
        u = tl.load(X + row * stride_x + I + cols, mask=m, other=0.0)
        # silu rounded to the input dtype first, as F.silu(gate) * up does
        s = (g / (1.0 + tl.exp(-g))).to(X.dtype.element_ty)
        tl.store(OUT + row * I + cols, s * u, mask=m)
