"""Greedy acceptance of a step's drafts in one kernel (the all-greedy case of ``spec.accept``).

Per row: accept drafts while each equals the target's argmax at its position (and the row verifies that
many drafts), then emit the accepted drafts followed by the bonus token, the argmax at the first position
not accepted. The PyTorch version takes about ten small kernels (compare, prefix product, sum, gathers,
concatenation); in a CUDA-graph step of a small model each launch costs about what the work does.
"""

from __future__ import annotations

import torch

from specserve.kernels import use_triton
from specserve.kernels.pdl import launch, pdl

try:
    import triton
    import triton.language as tl

    from specserve.kernels.pdl import pdl_begin, pdl_wait
except ImportError:
    triton = None


def greedy_accept_ref(argmax: torch.Tensor, drafts: torch.Tensor, valid: torch.Tensor):
    """argmax [B, D+1], drafts [B, D], valid [B, D] bool -> (accepted [B], emitted [B, D+1]) int64."""
    b, d = drafts.shape
    accepted = accepted_prefix((drafts == argmax[:, :d]) & valid)
    bonus = argmax[torch.arange(b, device=argmax.device), accepted]
    return accepted, emit(drafts, bonus, accepted)


def accepted_prefix(ok: torch.Tensor) -> torch.Tensor:
    """ok [B, D] bool -> [B] int64: length of each row's all-true prefix."""
    return ok.to(torch.int64).cumprod(dim=1).sum(dim=1)


def emit(drafts: torch.Tensor, bonus: torch.Tensor, accepted: torch.Tensor) -> torch.Tensor:
    """[B, D+1]: accepted drafts, the bonus at index ``accepted``, then the bonus again (unused)."""
    b, d = drafts.shape
    cols = torch.arange(d + 1, device=drafts.device)
    padded = torch.cat((drafts, bonus[:, None]), dim=1)
    return torch.where(cols[None, :] < accepted[:, None], padded, bonus[:, None])


def greedy_accept(argmax: torch.Tensor, drafts: torch.Tensor, num_drafts: torch.Tensor, can_accept: torch.Tensor):
    """argmax [B, D+1] int64 (the target's token at each verified position), drafts [B, D], num_drafts [B],
    can_accept [B] bool -> (accepted [B], emitted [B, D+1]) int64, as ``greedy_accept_ref``."""
    b, d = drafts.shape
    if not use_triton(argmax) or d == 0:
        cols = torch.arange(d, device=drafts.device)
        return greedy_accept_ref(argmax, drafts, (cols[None, :] < num_drafts[:, None]) & can_accept[:, None])
    # the kernel reads rows with unit column stride (no-ops for the worker's tensors)
    argmax, drafts, num_drafts, can_accept = (x.contiguous() for x in (argmax, drafts, num_drafts, can_accept))
    accepted = torch.empty(b, dtype=torch.int64, device=argmax.device)
    emitted = torch.empty(b, d + 1, dtype=torch.int64, device=argmax.device)
    if b:
        on = pdl(argmax)
        _greedy_accept_kernel[(b,)](argmax, drafts, num_drafts, can_accept, accepted, emitted, d,
                                    argmax.stride(0), drafts.stride(0), BLOCK=triton.next_power_of_2(d + 1),
                                    PDL=on, **launch(on))
    return accepted, emitted


if triton is not None:
    @triton.jit
    def _greedy_accept_kernel(ARGMAX, DRAFTS, NUM, CAN, ACC, EMIT, D, s_a, s_d, BLOCK: tl.constexpr,
                              PDL: tl.constexpr):
        pdl_begin(PDL)
        pdl_wait(PDL)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        tgt = tl.load(ARGMAX + row * s_a + cols, mask=cols <= D, other=-1)  # [BLOCK]: positions 0..D
        drf = tl.load(DRAFTS + row * s_d + cols, mask=cols < D, other=-2)  # [BLOCK]: drafts 1..D
        n = tl.load(NUM + row) * (tl.load(CAN + row) != 0).to(tl.int64)  # drafts this row may accept
        ok = (drf == tgt) & (cols < n)
        # accepted = length of the all-true prefix = index of the first position that is not ok
        acc = tl.min(tl.where(ok, BLOCK, cols), axis=0)
        bonus = tl.sum(tl.where(cols == acc, tgt, 0), axis=0)
        tl.store(ACC + row, acc.to(tl.int64))
        tl.store(EMIT + row * (D + 1) + cols, tl.where(cols < acc, drf, bonus).to(tl.int64), mask=cols <= D)
