"""Argmax over a vocabulary-sized last dimension in two short kernels.

A generation step takes an argmax over the vocabulary for every verified position and every draft step. With
few rows, PyTorch's reduction runs a single block per row over the whole vocabulary (measured on the H200:
about 13 µs for one row of 49,152 logits, five times per speculative step of the default model). Here the
first kernel reduces chunks of ``CHUNK`` columns in parallel, the second picks the best chunk per row. Ties go
to the lowest index, as ``torch.argmax`` documents, so both paths pick the same token.
"""

from __future__ import annotations

import torch

from specserve.kernels import use_triton
from specserve.kernels.pdl import kernel_args

from specserve.kernels._triton import HAVE_TRITON, tl, triton

if HAVE_TRITON:
    from specserve.kernels.pdl import pdl_begin, pdl_wait

CHUNK = 2048  # columns per program of the first kernel
MAX_CHUNKS = 1024  # past this many chunks per row the second kernel's tile grows too big: use PyTorch
MAX_PICK = 4096  # chunks the second kernel reduces in one tile (a draft output layer's programs: 1,536)
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # compared in float32 exactly (float64 would not be)


def argmax_lastdim(x: torch.Tensor, ids: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., V] (float32 / bfloat16 / float16) -> index of the largest entry per row [...] int64; with ``ids``
    [V] int64, ``ids`` at that index (a draft vocabulary's target ids: the lookup rides in the second kernel)."""
    v = x.shape[-1]
    n_chunks = triton.cdiv(v, CHUNK) if HAVE_TRITON else 0
    if not use_triton(x) or x.numel() == 0 or n_chunks > MAX_CHUNKS or x.dtype not in _DTYPES:
        best = x.argmax(dim=-1)
        return best if ids is None else ids[best]
    lead = x.shape[:-1]
    x2 = x.reshape(-1, v)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    n = x2.shape[0]
    part_v = torch.empty(n, n_chunks, dtype=torch.float32, device=x.device)
    part_i = torch.empty(n, n_chunks, dtype=torch.int64, device=x.device)
    _argmax_chunks[(n, n_chunks)](x2, part_v, part_i, v, x2.stride(0), n_chunks, CHUNK=CHUNK, **kernel_args(x))
    return argmax_pick(part_v, part_i, ids).view(lead)


def pick_fits(n_chunks: int) -> bool:
    """Whether ``argmax_pick`` takes this many chunks per row in one tile."""
    return HAVE_TRITON and 0 < n_chunks <= MAX_PICK


def argmax_pick(part_v: torch.Tensor, part_i: torch.Tensor, ids: torch.Tensor | None = None,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """Each chunk's largest value and its index, part_v / part_i [N, C] (float32, int64; C <= MAX_PICK) -> the
    index of the largest per row [N] int64, the lowest chunk on ties (with ``ids``: ``ids`` at that index),
    written to ``out`` [N] int64 (any stride, e.g. a column of the step's result) when given."""
    n, nc = part_v.shape
    if out is None:
        out = torch.empty(n, dtype=torch.int64, device=part_v.device)
    _argmax_pick[(n,)](part_v, part_i, out, nc, out if ids is None else ids, out.stride(0),
                       BLOCK=triton.next_power_of_2(nc), MAP=ids is not None, **kernel_args(part_v))
    return out


if HAVE_TRITON:
    @triton.jit
    def _argmax_chunks(X, PV, PI, V, s_x, NC, CHUNK: tl.constexpr, PDL: tl.constexpr):
        pdl_begin(PDL)
        pdl_wait(PDL)
        row = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1)
        cols = c * CHUNK + tl.arange(0, CHUNK)
        x = tl.load(X + row * s_x + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        best, at = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
        tl.store(PV + row * NC + c, best)
        tl.store(PI + row * NC + c, (c * CHUNK + at).to(tl.int64))

    @triton.jit
    def _argmax_pick(PV, PI, OUT, NC, IDS, s_out, BLOCK: tl.constexpr, MAP: tl.constexpr, PDL: tl.constexpr):
        pdl_begin(PDL)
        pdl_wait(PDL)
        row = tl.program_id(0).to(tl.int64)
        k = tl.arange(0, BLOCK)
        pv = tl.load(PV + row * NC + k, mask=k < NC, other=float("-inf"))
        _, at = tl.max(pv, axis=0, return_indices=True, return_indices_tie_break_left=True)
        best = tl.load(PI + row * NC + at)
        if MAP:
            best = tl.load(IDS + best)
        tl.store(OUT + row * s_out, best)
