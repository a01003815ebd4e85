"""A tree step's attention layout in one kernel (``tree_attention_layout_ref`` is its reference).

A generation row that verifies a tree holds its root (the last known token) in column 0 and node c in column c;
node c sits at position start + depth(c) and its attention sees the keys before the root and those of its
ancestors and itself, an int64 of bits by column (``AttentionMetadata.tree_bits``). The reference builds both by
iterating a gather over the parents once a depth, about forty small kernels a step; the kernel walks every
column's ancestors at once.
"""

from __future__ import annotations

import torch

from specserve.kernels import kernel_failed, kernel_usable, use_triton
from specserve.kernels._triton import HAVE_TRITON, tl, triton
from specserve.kernels.pdl import kernel_args
from specserve.kernels.step_inputs import node_depths

if HAVE_TRITON:
    from specserve.kernels.pdl import pdl_begin, pdl_wait


def tree_attention_layout_ref(parents: torch.Tensor, nd: torch.Tensor, start: torch.Tensor, positions: torch.Tensor,
                    depth: int) -> tuple[torch.Tensor, torch.Tensor]:
    """parents [B, n] (columns, 0 the root), nd [B] (a row's live nodes: its first nd), start [B] (the root's
    position), positions [B, q] (the layout's, by column) -> (the positions as given, a copy [B, q]; ancestor bits
    [B, q], -1 where a column follows the causal rule); a live column's position becomes start + its depth, in
    place. ``depth``: the deepest a node can be. A row without nodes keeps the causal rule; a layout narrower
    than the root and n nodes (a one-row prefill) covers what fits."""
    b, q = positions.shape
    n = parents.shape[1]
    dev = parents.device
    cols = torch.arange(n + 1, device=dev)
    bits = torch.bitwise_left_shift(torch.ones_like(cols), cols).expand(b, n + 1).clone()  # [B, n+1]
    for _ in range(depth):
        bits[:, 1:] = bits.gather(1, parents) | bits[:, 1:]
    m = min(q, n + 1)
    live = (nd > 0)[:, None] & (cols[None, :m] <= nd[:, None])  # [B, m]: the root and the row's nodes
    before = positions.clone()
    positions[:, :m] = torch.where(live, start[:, None] + node_depths(parents, depth)[:, :m], positions[:, :m])
    out = torch.full((b, q), -1, dtype=torch.int64, device=dev)
    out[:, :m] = torch.where(live, bits[:, :m], -1)
    return before, out


def tree_attention_layout(parents: torch.Tensor, nd: torch.Tensor, start: torch.Tensor, positions: torch.Tensor,
                depth: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``tree_attention_layout_ref`` in one kernel on the GPU (a program a row)."""
    if not use_triton(positions) or not kernel_usable("tree_attention_layout") or not positions.is_contiguous():
        return tree_attention_layout_ref(parents, nd, start, positions, depth)
    b, q = positions.shape
    n = parents.shape[1]
    before = torch.empty_like(positions)
    bits = torch.empty_like(positions)
    ins = [x.contiguous() for x in (parents, nd, start)]
    try:
        _tree_layout_kernel[(b,)](*ins, positions, before, bits, q, n, DEPTH=depth,
                                  QP=triton.next_power_of_2(q), **kernel_args(positions))
    except Exception as e:  # noqa: BLE001 (a kernel this Triton cannot build: the reference runs instead)
        kernel_failed("tree_attention_layout", e)
        return tree_attention_layout_ref(parents, nd, start, positions, depth)
    return before, bits


if HAVE_TRITON:
    @triton.jit
    def _tree_layout_kernel(PAR, ND, START, POS, BEFORE, BITS, Q, N, DEPTH: tl.constexpr, QP: tl.constexpr,
                            PDL: tl.constexpr):
        pdl_begin(PDL)
        pdl_wait(PDL)
        b = tl.program_id(0).to(tl.int64)
        c = tl.arange(0, QP)
        cm = c < Q
        pos = tl.load(POS + b * Q + c, mask=cm, other=0)
        tl.store(BEFORE + b * Q + c, pos, mask=cm)
        nd = tl.load(ND + b)
        live = cm & (c <= N) & (nd > 0) & (c <= nd)
        # walk up from every column at once: its ancestors' bits, and its depth as the steps to the root
        p = tl.where(live, c, 0).to(tl.int64)
        acc = tl.full((QP,), 1, tl.int64) << p
        dep = tl.zeros((QP,), dtype=tl.int64)
        for _ in tl.static_range(DEPTH):
            up = live & (p > 0) & (p <= N)  # (a stale parent past the row's columns ends the walk: nothing read)
            p = tl.where(up, tl.load(PAR + b * N + p - 1, mask=up, other=0), p)
            up = up & (p <= N)  # ... and counts for nothing
            acc = acc | tl.where(up, tl.full((QP,), 1, tl.int64) << p, 0)
            dep += up.to(tl.int64)
        tl.store(POS + b * Q + c, tl.load(START + b) + dep, mask=live)
        tl.store(BITS + b * Q + c, tl.where(live, acc, -1), mask=cm)


__all__ = ["tree_attention_layout", "tree_attention_layout_ref"]
