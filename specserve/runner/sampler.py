"""Batched sampling on the device: greedy, temperature, top-k, top-p, min-p, per-request seeds.

Randomness is a counter-based hash of (request seed, output index, token id), turned into Gumbel
noise: ``argmax(logits / T + Gumbel)`` draws from ``softmax(logits / T)``. A request's draws therefore
depend only on its own seed and position, not on what else is in the batch, whether it was preempted,
or how its prompt was chunked; and the whole sampler is a fixed sequence of tensor ops with no host
synchronisation (capturable in a CUDA graph).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.kernels.argmax import argmax_lastdim

_M32 = 0xFFFFFFFF


def hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mixer on int64 tensors holding values in [0, 2**32).

    Multipliers are below 2**31 so no product overflows int64.
    """
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x1B873593) & _M32
    x = x ^ (x >> 16)
    return x


def uniform_noise(seeds: torch.Tensor, offsets: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """seeds [S] int64, offsets [S] int64 -> uniform (0, 1) float32 [S, V], a pure function of its inputs."""
    row = hash32((hash32(seeds & _M32) ^ (offsets * 0x2545F491 & _M32)) & _M32)  # [S]
    col = hash32(torch.arange(vocab_size, device=seeds.device, dtype=torch.int64) + 0x3C6EF372)  # [V]
    h = hash32(row[:, None] ^ col[None, :])  # [S, V]
    return ((h >> 8).float() + 0.5) * (1.0 / (1 << 24))


@dataclass
class SamplingTensors:
    """Per-row sampling parameters on the device; rows line up with the logits rows."""

    temperature: torch.Tensor  # [S] float32, 0 for greedy rows
    top_k: torch.Tensor  # [S] int64, vocab size when disabled
    top_p: torch.Tensor  # [S] float32, 1.0 when disabled
    min_p: torch.Tensor  # [S] float32, 0.0 when disabled
    seeds: torch.Tensor  # [S] int64
    offsets: torch.Tensor  # [S] int64: index of the output token being drawn
    all_greedy: bool  # host-known: skip the random path entirely
    needs_filter: bool  # host-known: some row uses top-k/top-p/min-p


def processed_logits(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """logits [S, V] float32 -> temperature-scaled logits with filtered tokens at -inf [S, V].

    softmax of the result is the request's target distribution (used by sampling and, later, by
    speculative rejection sampling).
    """
    temp = torch.where(t.temperature > 0, t.temperature, torch.ones_like(t.temperature))
    logits = logits / temp[:, None]
    if not t.needs_filter:
        return logits
    v = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [S, V]
    ranks = torch.arange(v, device=logits.device)
    drop = ranks[None, :] >= t.top_k[:, None]  # top-k
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    drop |= (probs.cumsum(dim=-1) - probs) > t.top_p[:, None]  # top-p: keep the smallest prefix reaching p
    drop |= probs < t.min_p[:, None] * probs[:, :1]  # min-p, relative to the most likely token
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def sample(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """logits [S, V] float32 (any float dtype when ``t.all_greedy``) -> token ids [S] int64."""
    greedy = argmax_lastdim(logits)
    if t.all_greedy:
        return greedy
    scores = processed_logits(logits, t)
    u = uniform_noise(t.seeds, t.offsets, logits.shape[-1])
    drawn = (scores - torch.log(-torch.log(u))).argmax(dim=-1)
    return torch.where(t.temperature > 0, drawn, greedy)
