"""Greedy acceptance of a step's drafts in one kernel (the all-greedy case of ``spec.accept``, forced acceptance too).

Per row: accept drafts while each equals the target's argmax at its position (and the row verifies that
many drafts), then emit the accepted drafts followed by the bonus token, the argmax at the first position
not accepted. The PyTorch version takes about ten small kernels (compare, prefix product, sum, gathers,
concatenation); in a CUDA-graph step of a small model each launch costs about what the work does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.kernels import use_triton
from specserve.kernels.pdl import kernel_args

from specserve.kernels._triton import HAVE_TRITON, tl, triton

if HAVE_TRITON:
    from specserve.kernels.pdl import pdl_begin, pdl_wait


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


@dataclass
class ForcedDraw:
    """Forced acceptance (benchmarks, ``spec.accept``): each row accepts ``base`` drafts, one more where its
    uniform draw u < ``frac``, u = ((hash32(hash32(seed ^ salt) ^ offset * 0x2545F491) >> 8) + 0.5) / 2**24 with
    seed ^ salt and each product taken mod 2**32 (``spec.accept._uniform_scalar``'s), at most what it may accept."""

    base: int
    frac: float
    seeds: torch.Tensor  # [B] int64
    offsets: torch.Tensor  # [B] int64
    salt: int  # below 2**32


def greedy_accept(argmax: torch.Tensor, drafts: torch.Tensor, num_drafts: torch.Tensor, can_accept: torch.Tensor,
                  forced: ForcedDraw | None = None, out: torch.Tensor | None = None):
    """argmax [B, D+1] int64 (the target's token at each verified position), drafts [B, D], num_drafts [B],
    can_accept [B] bool -> (accepted [B], emitted [B, D+1]) int64, as ``greedy_accept_ref``; with ``forced``, the
    drafts ``ForcedDraw`` counts accepted whatever they are, in the same kernel (the caller's ops elsewhere:
    None there). ``out`` [D+2, B] int64 (rows of the step's result): the kernel writes accepted to out[0] and
    emitted to out[1:].t() and returns those views (the reference returns tensors of its own)."""
    b, d = drafts.shape
    if forced is not None and (not use_triton(argmax) or d == 0):
        return None
    if not use_triton(argmax) or d == 0:
        cols = torch.arange(d, device=drafts.device)
        return greedy_accept_ref(argmax, drafts, (cols[None, :] < num_drafts[:, None]) & can_accept[:, None])
    # the kernel reads rows with unit column stride (no-ops for the worker's tensors)
    argmax, drafts, num_drafts, can_accept = (x.contiguous() for x in (argmax, drafts, num_drafts, can_accept))
    if out is None:
        out = torch.empty(d + 2, b, dtype=torch.int64, device=argmax.device)
    accepted, emitted = out[0], out[1:].t()  # [B], [B, D+1] (strides 1, B)
    if b:
        f = forced
        draw = (f.seeds.contiguous(), f.offsets.contiguous(), f.frac) if f else (argmax, argmax, 0.0)
        _greedy_accept_kernel[(b,)](argmax, drafts, num_drafts, can_accept, accepted, emitted, d,
                                    argmax.stride(0), drafts.stride(0), accepted.stride(0), *emitted.stride(), *draw,
                                    BLOCK=triton.next_power_of_2(d + 1), FORCE=f is not None,
                                    BASE=f.base if f else 0, SALT=f.salt if f else 0, **kernel_args(argmax))
    return accepted, emitted


if HAVE_TRITON:
    @triton.jit
    def _greedy_accept_kernel(ARGMAX, DRAFTS, NUM, CAN, ACC, EMIT, D, s_a, s_d, s_acc, s_er, s_ec, SEEDS, OFFS, frac,
                              BLOCK: tl.constexpr, FORCE: tl.constexpr, BASE: tl.constexpr, SALT: tl.constexpr,
                              PDL: tl.constexpr):
        pdl_begin(PDL)
        pdl_wait(PDL)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        tgt = tl.load(ARGMAX + row * s_a + cols, mask=cols <= D, other=-1)  # [BLOCK]: positions 0..D
        drf = tl.load(DRAFTS + row * s_d + cols, mask=cols < D, other=-2)  # [BLOCK]: drafts 1..D
        n = tl.load(NUM + row) * (tl.load(CAN + row) != 0).to(tl.int64)  # drafts this row may accept
        if FORCE:  # ForcedDraw: that many drafts, whatever they are
            m32 = tl.full([], 65535, tl.int64) * 65536 + 65535  # 2**32 - 1 as int64 (a literal would be uint32)
            h = _hash32((tl.load(SEEDS + row) ^ SALT) & m32, m32)
            h = _hash32((h ^ ((tl.load(OFFS + row) * 0x2545F491) & m32)) & m32, m32)
            u = ((h >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
            n = tl.minimum(BASE + (u < frac).to(tl.int64), n)
            ok = cols < n
        else:
            ok = (drf == tgt) & (cols < n)
        # accepted = length of the all-true prefix = index of the first position that is not ok
        acc = tl.min(tl.where(ok, BLOCK, cols), axis=0)
        bonus = tl.sum(tl.where(cols == acc, tgt, 0), axis=0)
        tl.store(ACC + row * s_acc, acc.to(tl.int64))
        tl.store(EMIT + row * s_er + cols * s_ec, tl.where(cols < acc, drf, bonus).to(tl.int64), mask=cols <= D)

    @triton.jit
    def _hash32(x, m32):
        """``runner.sampler.hash32`` on an int64 holding a value below 2**32."""
        x = x ^ (x >> 16)
        x = (x * 0x7FEB352D) & m32
        x = x ^ (x >> 15)
        x = (x * 0x1B873593) & m32
        return x ^ (x >> 16)
