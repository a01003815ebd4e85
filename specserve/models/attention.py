"""Attention over the paged KV cache, through PyTorch SDPA (CPU and CUDA).

A step's tokens are packed flat (``[T]``) for the linear layers. Attention regroups them per request
into a padded ``[B, Q]`` query layout, gathers each request's keys/values from its block table
(``[B, K]`` with ``K = blocks_per_seq * block_size``; key ``j`` is the token at position ``j``), and
masks key ``j`` for a query at position ``p`` unless ``j <= p`` (causal and length mask in one).
All index tensors are built by the runner once per step, on the host, and copied in one go; nothing
here reads a device value on the host, so a step can be captured in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    """Device tensors describing one step's attention layout (shared by all layers)."""

    slot_mapping: torch.Tensor  # [T] int64: flat cache slot (block * block_size + offset) each token writes
    block_tables: torch.Tensor  # [B, M] int64: physical block ids per request (padding -> reserved block 0)
    query_index: torch.Tensor  # [B, Q] int64: flat token index of each padded query (padding -> T, a zero row)
    flat_index: torch.Tensor  # [T] int64: b * Q + q for each flat token (gathers padded outputs back)
    mask: torch.Tensor  # [B, 1, Q, K] bool: True where query may attend key


def build_mask(query_pos: torch.Tensor, num_keys: int, sliding_window: int | None) -> torch.Tensor:
    """query_pos [B, Q] int64 (padding rows 0) -> mask [B, 1, Q, K] bool."""
    keys = torch.arange(num_keys, device=query_pos.device)  # [K]
    qp = query_pos.unsqueeze(-1)  # [B, Q, 1]
    mask = keys <= qp
    if sliding_window is not None:
        mask &= keys > qp - sliding_window
    return mask.unsqueeze(1)


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """k_cache/v_cache [N, block_size, Hkv, D]; k/v [T, Hkv, D]; slot_mapping [T]."""
    n, bs, h, d = k_cache.shape
    k_cache.view(n * bs, h, d).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(n * bs, h, d).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """q [T, Hq, D] (keys already written) -> out [T, Hq, D]."""
    t, hq, d = q.shape
    b, qlen = meta.query_index.shape
    hkv = k_cache.shape[2]
    q_pad = torch.cat((q, q.new_zeros(1, hq, d)))[meta.query_index]  # [B, Q, Hq, D]
    k = k_cache[meta.block_tables].view(b, -1, hkv, d)  # [B, K, Hkv, D]
    v = v_cache[meta.block_tables].view(b, -1, hkv, d)
    out = F.scaled_dot_product_attention(
        q_pad.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=meta.mask,
        scale=scale,
        enable_gqa=hq != hkv,
    )  # [B, Hq, Q, D]
    return out.transpose(1, 2).reshape(b * qlen, hq, d)[meta.flat_index]
