"""Acceptance of drafts against the target's tokens, on the device (no host sync).

Vocabulary (after vLLM's rejection sampler): *drafts* are the head's proposals; a draft is *accepted*
while it equals the target's token at its position; the *bonus* token is the target's token at the first
position that was not accepted (or after the last draft when all were accepted). Emitted tokens are the
accepted drafts followed by the bonus: 1 <= emitted <= D + 1.
"""

from __future__ import annotations

import torch


def greedy_accept(
    target: torch.Tensor,
    drafts: torch.Tensor,
    num_drafts: torch.Tensor,
    can_accept: torch.Tensor,
    forced: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Longest-prefix acceptance.

    target [B, D+1] int64: the target's token at each verified position (argmax for greedy rows).
    drafts [B, D] int64: drafts verified this step (entries past ``num_drafts`` are ignored).
    num_drafts [B] int64: drafts each row verifies (0 for rows that verify none).
    can_accept [B] bool: rows allowed to accept drafts (False rows take the target token at position 0).
    forced: accept exactly ``min(forced, num_drafts)`` drafts whatever they are (breaks losslessness).

    Returns (accepted [B] int64, emitted [B, D+1] int64); row r emits ``emitted[r, :accepted[r] + 1]``.
    """
    d = drafts.shape[1]
    cols = torch.arange(d, device=drafts.device)
    valid = (cols[None, :] < num_drafts[:, None]) & can_accept[:, None]  # [B, D]
    if forced is None:
        match = (drafts == target[:, :d]) & valid
        accepted = match.to(torch.int64).cumprod(dim=1).sum(dim=1)  # [B]
    else:
        accepted = torch.minimum(torch.full_like(num_drafts, forced), num_drafts * can_accept)
    take_draft = cols[None, :] < accepted[:, None]  # [B, D]
    emitted = target.clone()
    emitted[:, :d] = torch.where(take_draft, drafts, target[:, :d])
    return accepted, emitted
