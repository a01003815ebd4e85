"""Acceptance of a draft tree against the target, and the accepted path's KV moved into place (device, PyTorch).

A row verifies its last known token (column 0, the root) and N draft nodes (columns 1..N) in one pass. Node c has
a parent column ``parents[c - 1]`` < c, so columns are in topological order (the drafter sorts them by depth).

- greedy: a node is accepted when its parent is and its token is the target's argmax at the parent; the deepest
  accepted node ends the path (siblings are distinct tokens, so at most one child of a node matches), and the bonus
  is the argmax there. Output equals non-speculative greedy decoding.
- sampled (lossless multi-draft speculative sampling with one-hot drafts): at the current node, its children are
  tried in column order; child x is accepted with probability r(x) / sum(r), r the target's processed distribution
  with the children already rejected removed; the first accepted child becomes the current node. When none is
  accepted the bonus is drawn from r. The first child's draw and the bonus's noise are a chain's, so a tree of one
  child per node gives a chain's tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.kernels.argmax import argmax_lastdim
from specserve.kernels.step_inputs import node_depths
from specserve.kernels.tree_accept import tree_compact_kv, tree_greedy_accept
from specserve.runner.sampler import SamplingTensors, hash32, processed_logits, uniform_noise
from specserve.speculative.accept import AcceptInputs, _uniform_scalar

_SIBLING_SALT = 0x68E31DA4  # the draws of second and later siblings apart from the first one's


@dataclass
class TreeResult:
    """A tree step's acceptance, per row (B rows, D = depth)."""

    accepted: torch.Tensor  # [B] int64: depth of the accepted path
    path: torch.Tensor  # [B, D] int64: column of the accepted node at each depth 1..accepted (0 past it)
    emitted: torch.Tensor  # [B, D+1] int64: the path's tokens, then the bonus


def accept_tree(logits: torch.Tensor, nodes: torch.Tensor, parents: torch.Tensor, num_nodes: torch.Tensor,
                depth: int, topk: int, a: AcceptInputs) -> TreeResult:
    """logits [B, N+1, V] at the root and every node (float32, any float dtype for greedy-only batches); nodes,
    parents [B, N]; num_nodes [B] (nodes past a row's count are not verified); at most ``topk`` children a node
    -> the accepted path per row."""
    b, n1, v = logits.shape
    argmax = argmax_lastdim(logits)  # [B, N+1]
    fast = tree_greedy_accept(argmax, nodes, parents, num_nodes, a.can_accept, depth)  # one kernel on the GPU
    if fast is not None and a.simple_greedy:
        return TreeResult(*fast)
    cols = torch.arange(n1 - 1, device=logits.device)
    valid = (cols[None, :] < num_nodes[:, None]) & a.can_accept[:, None]  # [B, N]
    greedy = TreeResult(*fast) if fast is not None else accept_greedy_ref(argmax, nodes, parents, valid, depth)
    if a.simple_greedy:
        return greedy
    sampled = _accept_sampled(logits, nodes, parents, valid, depth, topk, a)
    pick = a.greedy
    return TreeResult(torch.where(pick, greedy.accepted, sampled.accepted),
                      torch.where(pick[:, None], greedy.path, sampled.path),
                      torch.where(pick[:, None], greedy.emitted, sampled.emitted))


def accept_greedy_ref(argmax: torch.Tensor, nodes, parents, valid, depth: int) -> TreeResult:
    """argmax [B, N+1], valid [B, N] -> the deepest node whose path matches the argmax at every step (ties: the
    first column of that depth); ``kernels.tree_accept`` computes the same in one kernel."""
    b = argmax.shape[0]
    match = (nodes == argmax.gather(1, parents)) & valid  # [B, N]
    ok = torch.ones_like(argmax, dtype=torch.bool)  # [B, N+1]
    for _ in range(depth):
        ok[:, 1:] = match & ok.gather(1, parents)
    dep = node_depths(parents, depth)
    best = torch.where(ok, dep, -1).argmax(dim=1)  # [B]: deepest accepted column (the root when none)
    rows = torch.arange(b, device=argmax.device)
    path = _path(best, parents, dep, depth)
    accepted = dep[rows, best]
    return TreeResult(accepted, path, _emit(nodes, path, accepted, argmax[rows, best]))


def _path(best: torch.Tensor, parents: torch.Tensor, dep: torch.Tensor, depth: int) -> torch.Tensor:
    """The columns from depth 1 down to ``best`` [B] -> [B, D] (0 past the path)."""
    b = best.shape[0]
    full = torch.cat((torch.zeros(b, 1, dtype=parents.dtype, device=parents.device), parents), 1)  # [B, N+1]
    path = torch.zeros(b, depth, dtype=torch.int64, device=best.device)
    rows = torch.arange(b, device=best.device)
    cur = best
    for _ in range(depth):
        d = dep[rows, cur]
        path[rows, (d - 1).clamp(min=0)] = torch.where(d > 0, cur, path[rows, (d - 1).clamp(min=0)])
        cur = full[rows, cur]
    return path


def _emit(nodes: torch.Tensor, path: torch.Tensor, accepted: torch.Tensor, bonus: torch.Tensor) -> torch.Tensor:
    """The path's node tokens, then the bonus at column ``accepted`` -> [B, D+1]."""
    b, d = path.shape
    toks = nodes.gather(1, (path - 1).clamp(min=0))  # [B, D]
    out = torch.cat((toks, torch.zeros(b, 1, dtype=toks.dtype, device=toks.device)), 1)
    j = torch.arange(d + 1, device=path.device)
    out = torch.where(j[None, :] < accepted[:, None], out, 0)
    return out.scatter(1, accepted[:, None], bonus[:, None])


def _accept_sampled(logits, nodes, parents, valid, depth: int, topk: int, a: AcceptInputs) -> TreeResult:
    """Recursive rejection over each node's children, level by level (module docstring)."""
    b, n1, v = logits.shape
    dev = logits.device
    s = a.sampling
    rep = SamplingTensors(*(x.repeat_interleave(n1) for x in (s.temperature, s.top_k, s.top_p, s.min_p, s.seeds,
                                                               s.offsets)),
                          all_greedy=False, needs_filter=s.needs_filter)
    probs = processed_logits(logits.reshape(b * n1, v).float(), rep).softmax(dim=-1).view(b, n1, v)
    rows = torch.arange(b, device=dev)
    cur = torch.zeros(b, dtype=torch.int64, device=dev)  # the current node's column
    alive = torch.ones(b, dtype=torch.bool, device=dev)  # still descending
    accepted = torch.zeros(b, dtype=torch.int64, device=dev)
    path = torch.zeros(b, depth, dtype=torch.int64, device=dev)
    resid = probs[rows, cur].clone()  # [B, V]: the current node's distribution, rejected children removed
    for level in range(depth):
        children = (parents == cur[:, None]) & valid & alive[:, None]  # [B, N]
        rank = children.cumsum(dim=1) - 1  # sibling rank of each child
        took = torch.full((b,), -1, dtype=torch.int64, device=dev)  # the accepted child's column
        for r in range(topk):
            is_r = children & (rank == r)
            has = is_r.any(dim=1) & (took < 0)
            col = is_r.float().argmax(dim=1) + 1  # [B] the r-th child's column
            x = nodes[rows, col - 1]
            p_x = resid[rows, x] / resid.sum(dim=1).clamp(min=1e-30)
            u = _sibling_uniform(s.seeds, s.offsets + level, r)
            ok = has & (u < p_x)
            took = torch.where(ok, col, took)
            reject = has & ~ok & a.remove_rejected  # (False: the tests' deliberately biased control)
            resid[rows, x] = torch.where(reject, 0.0, resid[rows, x])
        moved = took >= 0
        path[:, level] = torch.where(moved, took, 0)
        accepted = accepted + moved.long()
        cur = torch.where(moved, took, cur)
        fresh = probs[rows, cur]
        resid = torch.where(moved[:, None], fresh, resid)
        alive = moved
    noise = uniform_noise(s.seeds, s.offsets + accepted, v)
    logr = torch.where(resid > 0, resid.log(), float("-inf"))  # a rejected or filtered token is never drawn
    bonus = (logr - torch.log(-torch.log(noise))).argmax(dim=-1)
    return TreeResult(accepted, path, _emit(nodes, path, accepted, bonus))


def _sibling_uniform(seeds: torch.Tensor, offsets: torch.Tensor, rank: int) -> torch.Tensor:
    """Uniform (0, 1) [B] for the acceptance draw of sibling ``rank`` at output index ``offsets``: the first
    sibling's is a chain's draft's (``accept._uniform_scalar``)."""
    if rank == 0:
        return _uniform_scalar(seeds, offsets[:, None])[:, 0]
    salted = hash32((seeds ^ (_SIBLING_SALT + rank)) & 0xFFFFFFFF)
    return _uniform_scalar(salted, offsets[:, None])[:, 0]


def compact_path_kv(kv: torch.Tensor, block_tables: torch.Tensor, root_pos: torch.Tensor, path: torch.Tensor,
                    accepted: torch.Tensor, block_size: int) -> None:
    """``compact_path_kv_ref``, in one kernel on the GPU (``kernels.tree_accept.tree_compact_kv``)."""
    if not tree_compact_kv(kv, block_tables, root_pos, path, accepted, block_size):
        compact_path_kv_ref(kv, block_tables, root_pos, path, accepted, block_size)


def compact_path_kv_ref(kv: torch.Tensor, block_tables: torch.Tensor, root_pos: torch.Tensor, path: torch.Tensor,
                        accepted: torch.Tensor, block_size: int) -> None:
    """Move the accepted path's KV in every layer of ``kv`` [layers, 2, blocks, block_size, Hkv, Dh] (contiguous)
    from its nodes' columns to the positions after the root: the node at depth i (column path[i-1], slot of root_pos
    + column) to root_pos + i; one gather and one scatter for all layers. Rows past their path copy the pad slot
    onto itself."""
    b, d = path.shape
    i = torch.arange(1, d + 1, device=path.device)
    live = i[None, :] <= accepted[:, None]  # [B, D]

    def slot(pos):
        blk = block_tables.gather(1, (pos // block_size).clamp(max=block_tables.shape[1] - 1))
        return torch.where(live, blk * block_size + pos % block_size, 0)

    src = slot(root_pos[:, None] + path).reshape(-1)
    dst = slot(root_pos[:, None] + i[None, :]).reshape(-1)
    flat = kv.view(kv.shape[0] * 2, kv.shape[2] * kv.shape[3], -1)  # [layers * 2, slots, Hkv * Dh]
    flat[:, dst] = flat[:, src]
