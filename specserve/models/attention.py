"""Attention over the paged KV cache: the step's layout (``AttentionMetadata``) and the dispatch to a backend.

A step's tokens are packed flat (``[T]``) for the linear layers. Attention regroups them per request
into a padded ``[B, Q]`` query layout (``query_index``, ``query_pos``); request b's key at position j lives
in block ``block_tables[b, j // block_size]``; a query at position p sees keys 0..p. Backends
(``specserve.kernels.attention``): ``triton`` (one paged kernel, reads only the blocks a row uses; the
default on CUDA) and ``sdpa`` (gathers the block tables into a dense layout and runs PyTorch SDPA with a
mask; the CPU path and the tested reference). All index tensors are built by the runner once per step;
nothing here reads a device value on the host, so a step can be captured in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specserve.kernels import use_triton
from specserve.kernels.attention import build_mask, causal_prompt_sdpa, paged_attention_sdpa, paged_attention_triton


@dataclass
class AttentionMetadata:
    """Device tensors describing one step's attention layout (shared by all layers)."""

    slot_mapping: torch.Tensor  # [T] int64: flat cache slot (block * block_size + offset) each token writes
    block_tables: torch.Tensor  # [B, M] int64: physical block ids per request (padding -> reserved block 0)
    query_index: torch.Tensor  # [B, Q] int64: flat token index of each padded query (padding -> T)
    query_pos: torch.Tensor  # [B, Q] int64: position of each query (padding -> 0)
    flat_index: torch.Tensor | None = None  # [T] int64: b * Q + q per flat token (SDPA backend; derived if None)
    sliding_window: int | None = None
    backend: str = "auto"  # "auto" (triton on CUDA, else sdpa), "triton" or "sdpa"
    # draft trees: [B, Q] int64 bit i set where the key at tree_base + i is the query's ancestor or itself (-1:
    # every key up to the query's position, an ordinary query); tree_base [B] int64. None: causal rows only
    tree_bits: torch.Tensor | None = None
    tree_base: torch.Tensor | None = None
    # host-known: every row's queries are its first tokens, positions 0, 1, ... in columns 0, 1, ... of the [B, Q]
    # layout (a prompt's first chunk, nothing cached before it), and the runner set it where ``causal_prompts``
    # holds: its attention is plain causal attention over the row's own first Q keys (``causal_prompt_sdpa``)
    from_zero: bool = False
    _mask: torch.Tensor | None = field(default=None, repr=False)  # SDPA mask, built once per step on first use

    def new_step(self) -> None:
        """Forget the cached SDPA mask: called at the start of every step's device work, so that a step
        captured in a CUDA graph builds its mask inside the graph (from query_pos in the staging buffer)."""
        self._mask = None

    def sdpa_mask(self, block_size: int) -> torch.Tensor:
        if self._mask is None:
            self._mask = build_mask(self.query_pos, self.block_tables.shape[1] * block_size, self.sliding_window,
                                    self.tree_bits, self.tree_base)
        return self._mask


def causal_prompts(backend: str) -> bool:
    """Whether steps whose rows all start at position 0 are marked ``from_zero`` (and so take
    ``causal_prompt_sdpa``) with this backend: the one rule packed steps and prefill graphs (whose key holds
    the mark) share. Every backend but "triton", which keeps every step on the paged kernel: on CUDA, SDPA's flash
    kernel over the gathered keys prefills a long prompt in a fraction of the paged kernel's time
    (docs/BENCHMARKS.md, "Long prompts")."""
    return backend != "triton"


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float, defer_merge: bool = False, q_rows=None, split_short: bool = False):
    """q [T, Hq, D] (this step's keys already in the cache) -> out [T, Hq, D]. ``defer_merge``: the Triton
    kernel's split partial sums may come back unmerged (``AttnPartials``) for the caller to merge;
    ``split_short``: the caller merges them at no kernel of its own, so a short table may split too. ``q_rows``
    [T'] (int64): attention for the queries q[q_rows] only (the layout ``meta`` has T' flat tokens) -> [T', Hq,
    D]; the Triton kernel reads those rows in place, the references gather them."""
    backend = meta.backend
    group = q.shape[1] // k_cache.shape[2]  # the Triton kernel packs a KV head's query heads in <= 64 rows
    if meta.from_zero and q_rows is None and meta.tree_bits is None and meta.sliding_window is None:
        return causal_prompt_sdpa(q, k_cache, v_cache, meta.block_tables, meta.query_index, scale, meta.flat_index)
    if backend == "sdpa" or (backend == "auto" and (not use_triton(q) or group > 64)):
        q = q if q_rows is None else q[q_rows]
        return paged_attention_sdpa(q, k_cache, v_cache, meta.block_tables, meta.query_index, meta.query_pos, scale,
                                    meta.sliding_window, flat_index=meta.flat_index,
                                    mask=meta.sdpa_mask(k_cache.shape[1]))
    return paged_attention_triton(q, k_cache, v_cache, meta.block_tables, meta.query_index, meta.query_pos, scale,
                                  meta.sliding_window, flat_index=meta.flat_index if defer_merge else None,
                                  q_rows=q_rows, split_short=defer_merge and split_short, tree_bits=meta.tree_bits,
                                  tree_base=meta.tree_base)

