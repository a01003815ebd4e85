"""Acceptance of drafts against the target, on the device (no host sync).

Vocabulary (after vLLM's rejection sampler): *drafts* are the head's proposals (argmax, so the draft
distribution q is one-hot); a draft is *accepted* by the row's rule; the *bonus* token comes from the
target at the first position that was not accepted (or after the last draft when all were). Emitted
tokens are the accepted drafts followed by the bonus: 1 <= emitted <= D + 1.

Rules, per row and per verified position:
- greedy (temperature 0): accept while the draft equals the target's argmax; the bonus is the argmax.
  Output equals non-speculative greedy decoding.
- sampled (lossless speculative sampling with one-hot q): accept draft x with probability p(x) under the
  row's processed distribution (temperature, top-k, top-p, min-p); on the first rejection the bonus is
  drawn from p with x removed and renormalised; after all accepted, from p at the last position. The
  output distribution equals non-speculative sampling.
- relaxed (thinking phase only, opt-in): accept x if it is the argmax, or if delta > 0, x is among the
  ``relaxed_topk`` most likely tokens and p(x) >= p(top1) - delta; the bonus is the top-1. The phase at
  each position follows the begin/end thinking tokens among the accepted drafts, in order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.kernels.accept import ForcedDraw, accepted_prefix, emit, greedy_accept
from specserve.kernels.argmax import argmax_lastdim
from specserve.runner.sampler import SamplingTensors, hash32, processed_logits, uniform_noise

_ACCEPT_SALT = 0x5BD1E995  # keeps acceptance draws independent of the sampling noise at the same index
_FORCED_SALT = 0x1F2E3D  # forced acceptance's draws apart from sampled acceptance's


@dataclass
class AcceptInputs:
    """Per-row acceptance settings on the device (B rows)."""

    sampling: SamplingTensors  # rows = B; offsets = index of the first token this step emits
    greedy: torch.Tensor  # [B] bool
    can_accept: torch.Tensor  # [B] bool: the row verifies drafts this step
    relaxed: torch.Tensor  # [B] bool: relaxed acceptance enabled for the row
    relaxed_topk: torch.Tensor  # [B] int64
    relaxed_delta: torch.Tensor  # [B] float32
    thinking: torch.Tensor  # [B] bool: in the thinking phase after the row's last known token
    begin_token: int = -1
    end_token: int = -1
    max_topk: int = 1  # host-known: the largest relaxed_topk of the batch (no device read)
    simple_greedy: bool = False  # host-known: every row greedy and none relaxed (skip the distribution work)
    remove_rejected: bool = True  # tests only: False gives a deliberately biased sampler


def thinking_states(drafts: torch.Tensor, thinking0: torch.Tensor, begin: int, end: int) -> torch.Tensor:
    """Phase before each verified position [B, D+1]: position 0 follows the last known token, position j
    follows drafts 1..j (the last begin/end token among them wins)."""
    b, d = drafts.shape
    if begin < 0 and end < 0:
        return thinking0[:, None].expand(b, d + 1)
    event = torch.where(drafts == begin, 1, torch.where(drafts == end, 0, -1))  # [B, D]
    cols = torch.arange(d, device=drafts.device)
    last = torch.where(event >= 0, cols, -1).cummax(dim=1).values  # [B, D] index of the latest event
    after = torch.where(last >= 0, event.gather(1, last.clamp(min=0)) == 1, thinking0[:, None])
    return torch.cat((thinking0[:, None], after), dim=1)


def _uniform_scalar(seeds: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """seeds [B], offsets [B, D] -> uniform (0, 1) [B, D], independent of ``uniform_noise``."""
    h = hash32((hash32((seeds[:, None] ^ _ACCEPT_SALT) & 0xFFFFFFFF) ^ (offsets * 0x2545F491 & 0xFFFFFFFF))
               & 0xFFFFFFFF)
    return ((h >> 8).float() + 0.5) * (1.0 / (1 << 24))


def accept(
    logits: torch.Tensor,
    drafts: torch.Tensor,
    num_drafts: torch.Tensor,
    a: AcceptInputs,
    forced: float | None = None,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, D+1, V] float32 at the verified positions (any float dtype when ``a.simple_greedy``: only their
    argmax is read); drafts [B, D]; num_drafts [B].

    Returns (accepted [B] int64, emitted [B, D+1] int64); row r emits ``emitted[r, :accepted[r] + 1]``. ``out``
    [D+2, B] int64: where greedy acceptance's kernel writes them (``kernels.accept.greedy_accept``); other paths
    return tensors of their own.
    ``forced`` accepts min(forced, num_drafts) drafts whatever they are (breaks losslessness); a fractional
    value accepts floor(forced) or floor(forced) + 1, the latter with probability frac(forced) per step (a
    hash of the row's seed and position), so the mean acceptance length is forced + 1.
    """
    b, d1, v = logits.shape
    d = d1 - 1
    argmax = argmax_lastdim(logits)  # [B, D+1]: also the argmax of every processed distribution
    if a.simple_greedy and forced is None:
        return greedy_accept(argmax, drafts, num_drafts, a.can_accept, out=out)  # one kernel on the GPU
    if a.simple_greedy:  # on the GPU one kernel, as greedy acceptance (a benchmark's step costs what a real one does)
        draw = ForcedDraw(int(forced), forced - int(forced), a.sampling.seeds, a.sampling.offsets,
                          _FORCED_SALT ^ _ACCEPT_SALT)
        got = greedy_accept(argmax, drafts, num_drafts, a.can_accept, forced=draw, out=out)
        if got is not None:
            return got
    rows = torch.arange(b, device=logits.device)
    if a.simple_greedy:
        accepted = _forced(forced, num_drafts, a)
        return accepted, emit(drafts, argmax[rows, accepted], accepted)
    cols = torch.arange(d, device=logits.device)
    valid = (cols[None, :] < num_drafts[:, None]) & a.can_accept[:, None]  # [B, D]
    greedy_ok = drafts == argmax[:, :d]

    n = a.sampling.temperature.shape[0]
    rep = SamplingTensors(*(x.repeat_interleave(d1) for x in (a.sampling.temperature, a.sampling.top_k,
                                                               a.sampling.top_p, a.sampling.min_p,
                                                               a.sampling.seeds, a.sampling.offsets)),
                          all_greedy=False, needs_filter=a.sampling.needs_filter)
    assert n == b
    logp = processed_logits(logits.reshape(b * d1, v), rep).view(b, d1, v).log_softmax(dim=-1)
    lp_draft = logp[:, :d].gather(-1, drafts[..., None]).squeeze(-1)  # [B, D]
    offsets = a.sampling.offsets[:, None] + cols[None, :]  # output index of the token at each position
    sampled_ok = _uniform_scalar(a.sampling.seeds, offsets).log() < lp_draft

    state = thinking_states(drafts, a.thinking, a.begin_token, a.end_token)  # [B, D+1]
    top1 = logp.max(dim=-1).values  # [B, D+1]
    kmax = max(1, min(a.max_topk, v))
    kth = logp[:, :d].topk(kmax, dim=-1).values.gather(
        -1, (a.relaxed_topk.clamp(1, kmax) - 1)[:, None, None].expand(b, d, 1)).squeeze(-1)  # [B, D]
    delta = a.relaxed_delta[:, None]
    relaxed_ok = greedy_ok | ((delta > 0) & (lp_draft >= kth) & (lp_draft.exp() >= top1[:, :d].exp() - delta))
    use_relaxed = a.relaxed[:, None] & state[:, :d]
    ok = torch.where(use_relaxed, relaxed_ok, torch.where(a.greedy[:, None], greedy_ok, sampled_ok)) & valid
    if forced is None:
        accepted = accepted_prefix(ok)
        rejected = accepted < num_drafts * a.can_accept  # a draft at position `accepted` was turned down
    else:
        accepted = _forced(forced, num_drafts, a)
        rejected = torch.zeros_like(a.greedy)

    # bonus token at position `accepted`
    lp_b = logp[rows, accepted]  # [B, V]
    x = drafts[rows, accepted.clamp(max=max(d - 1, 0))] if d > 0 else torch.zeros_like(accepted)
    if a.remove_rejected:
        lp_b = torch.where((rejected[:, None]) & (torch.arange(v, device=x.device)[None, :] == x[:, None]),
                           torch.full_like(lp_b, float("-inf")), lp_b)
    noise = uniform_noise(a.sampling.seeds, a.sampling.offsets + accepted, v)
    sampled_bonus = (lp_b - torch.log(-torch.log(noise))).argmax(dim=-1)
    relaxed_here = a.relaxed & state[rows, accepted]
    bonus = torch.where(a.greedy | relaxed_here, argmax[rows, accepted], sampled_bonus)
    return accepted, emit(drafts, bonus, accepted)


def _forced(forced: float, num_drafts: torch.Tensor, a: AcceptInputs) -> torch.Tensor:
    base = int(forced)
    k = torch.full_like(num_drafts, base)
    if forced > base:
        u = _uniform_scalar(a.sampling.seeds ^ _FORCED_SALT, a.sampling.offsets[:, None])[:, 0]  # [B]
        k = k + (u < forced - base).to(k.dtype)
    return torch.minimum(k, num_drafts * a.can_accept)
