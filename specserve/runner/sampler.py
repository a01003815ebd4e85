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
from specserve.sampling_params import MAX_LOGPROBS

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
    logprobs: int = -1  # host-known: the most top log-probabilities a row asks for (-1: no row asks for any)


# One request's sampling parameters as staged for a step, by name (``sampling_columns``); padding rows get the
# defaults, which sample greedily and filter nothing.
SAMPLING_INTS = {"top_k": None, "seeds": 0, "offsets": 0}  # None: the vocabulary size (top-k off)
SAMPLING_FLOATS = {"temperature": 0.0, "top_p": 1.0, "min_p": 0.0}


def sampling_switches(reqs) -> tuple[bool, bool, int]:
    """The host-known switches of a batch's sampling code: (every row greedy, some row filters top-k/p/min-p, the
    most top log-probabilities a row asks for, -1 when none asks)."""
    return (all(r.params.greedy for r in reqs), any(r.params.needs_filter for r in reqs),
            max((r.params.logprobs for r in reqs if r.params.logprobs is not None), default=-1))


LOGPROB_WIDTH = 2 + 2 * MAX_LOGPROBS  # floats a token's log-probabilities take in a step's result (``token_logprobs``)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, k: int) -> torch.Tensor:
    """logits [R, V] (any float dtype), tokens [R] -> per row [LOGPROB_WIDTH] float32: the token's log-probability
    under softmax(logits), its rank (1: the most likely), then the k largest log-probabilities and, after
    MAX_LOGPROBS of those slots, their token ids (exact as float32 below 2**24); unused slots 0."""
    lp = logits.float().log_softmax(dim=-1)  # [R, V]
    chosen = lp.gather(1, tokens[:, None])  # [R, 1]
    rank = (lp > chosen).sum(dim=1, keepdim=True).float() + 1
    out = torch.zeros(lp.shape[0], LOGPROB_WIDTH, dtype=torch.float32, device=lp.device)
    out[:, 0:1], out[:, 1:2] = chosen, rank
    if k:
        top = lp.topk(k, dim=-1)
        out[:, 2:2 + k] = top.values
        out[:, 2 + MAX_LOGPROBS:2 + MAX_LOGPROBS + k] = top.indices.float()
    return out


def parse_logprobs(row: list[float], k: int) -> tuple[float, int, list[tuple[int, float]]]:
    """One token's ``token_logprobs`` row -> (its log-probability, its rank, the k most likely (id, logprob))."""
    top = [(int(row[2 + MAX_LOGPROBS + j]), row[2 + j]) for j in range(k)]
    return row[0], int(row[1]), top


def sampling_columns(reqs, rows: int, vocab_size: int) -> tuple[dict[str, list[int]], dict[str, list[float]]]:
    """The one route from requests to staged sampling parameters: per name (``SAMPLING_INTS``,
    ``SAMPLING_FLOATS``) a list of ``rows`` values, requests first, then greedy padding rows."""
    ints: dict[str, list[int]] = {k: [] for k in SAMPLING_INTS}
    floats: dict[str, list[float]] = {k: [] for k in SAMPLING_FLOATS}
    for r in reqs:
        sp = r.params
        ints["top_k"].append(sp.top_k if sp.top_k > 0 else vocab_size)
        ints["seeds"].append(r.seed)
        ints["offsets"].append(r.num_output_tokens)  # index of the output token drawn: seeds its noise
        floats["temperature"].append(sp.temperature)
        floats["top_p"].append(sp.top_p)
        floats["min_p"].append(sp.min_p)
    pad = rows - len(reqs)
    for k, v in SAMPLING_INTS.items():
        ints[k] += [vocab_size if v is None else v] * pad
    for k, v in SAMPLING_FLOATS.items():
        floats[k] += [v] * pad
    return ints, floats


def sampling_tensors(reqs, views: dict[str, torch.Tensor]) -> SamplingTensors:
    """Device views of staged ``sampling_columns`` (by name, [S] each) -> the sampler's inputs. ``reqs`` are the
    real rows (their switches); rows past them are greedy padding."""
    all_greedy, needs_filter, logprobs = sampling_switches(reqs)
    return SamplingTensors(
        temperature=views["temperature"], top_p=views["top_p"], min_p=views["min_p"], top_k=views["top_k"],
        seeds=views["seeds"], offsets=views["offsets"], all_greedy=all_greedy, needs_filter=needs_filter,
        logprobs=logprobs)


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
