"""A draft tree's greedy acceptance, and its accepted path's KV moved into place, one kernel each (their references:
``speculative.tree_accept.accept_greedy_ref`` and ``compact_path_kv_ref``).

Per row, one program over the tree's columns (the root, 0, and N nodes): a node is accepted when it and every
ancestor below the root match the target's argmax at their parent; the deepest accepted node (the first column of
that depth) ends the path, and the bonus is the argmax there. The ancestors are found by walking up the parents
D times from every column at once (reads only, so the program needs no shared scratch), the path by walking up
from the deepest node. The PyTorch version takes about a hundred small kernels a step; in a CUDA-graph step of a
small model each costs about what its work does.

The path's KV: the node at depth i moves from its column to the position root + i in every layer. A program owns
one row and one layer's keys or values and moves depth 1, 2, ... in turn: a move writes only a position that no
later depth reads (a later depth's node sits at a column past it), and each thread reads and writes the same
elements of every slot, so the program needs no barrier.
"""

from __future__ import annotations

import torch

from specserve.kernels import kernel_failed, kernel_usable, use_triton
from specserve.kernels._triton import HAVE_TRITON, tl, triton
from specserve.kernels.pdl import kernel_args

if HAVE_TRITON:
    from specserve.kernels.pdl import pdl_begin, pdl_wait


def tree_greedy_accept(argmax: torch.Tensor, nodes: torch.Tensor, parents: torch.Tensor, num_nodes: torch.Tensor,
                       can_accept: torch.Tensor, depth: int):
    """argmax [B, N+1] (the target's token at the root and each node), nodes, parents [B, N], num_nodes [B],
    can_accept [B] bool -> (accepted [B], path [B, D], emitted [B, D+1]) int64 as the reference gives them, or
    None where the kernel does not run (the caller runs the reference)."""
    b, n = nodes.shape
    if not use_triton(argmax) or not kernel_usable("tree_accept") or n == 0 or n + 1 > 64:
        return None
    argmax, nodes, parents, num_nodes, can_accept = (x.contiguous() for x in (argmax, nodes, parents, num_nodes,
                                                                             can_accept))
    out = torch.empty(b, 1 + depth + depth + 1, dtype=torch.int64, device=argmax.device)
    try:
        if b:
            _tree_accept_kernel[(b,)](argmax, nodes, parents, num_nodes, can_accept, out, N=n, D=depth,
                                      BN=triton.next_power_of_2(n + 1), BE=triton.next_power_of_2(depth + 1),
                                      **kernel_args(argmax))
    except Exception as e:  # noqa: BLE001 (a kernel this Triton cannot build: the reference runs instead)
        kernel_failed("tree_accept", e)
        return None
    return out[:, 0], out[:, 1:1 + depth], out[:, 1 + depth:]


def tree_compact_kv(kv: torch.Tensor, block_tables: torch.Tensor, root_pos: torch.Tensor, path: torch.Tensor,
                    accepted: torch.Tensor, block_size: int) -> bool:
    """``compact_path_kv_ref`` in one kernel: kv [layers, 2, blocks, block_size, Hkv, Dh] (contiguous), block_tables
    [B, M], root_pos [B], path [B, D], accepted [B] -> True, or False where the kernel does not run."""
    b, d = path.shape
    if not use_triton(kv) or not kernel_usable("tree_compact") or not kv.is_contiguous() or d == 0:
        return False
    width = kv.shape[-2] * kv.shape[-1]  # elements of one slot of one layer's keys or values
    block_tables, root_pos, path, accepted = (x.contiguous() for x in (block_tables, root_pos, path, accepted))
    try:
        if b:
            _compact_kernel[(b, kv.shape[0] * 2)](
                kv, block_tables, root_pos, path, accepted, block_tables.shape[1], kv.shape[2] * block_size * width,
                BS=block_size, D=d, W=width, BW=triton.next_power_of_2(width), **kernel_args(kv))
    except Exception as e:  # noqa: BLE001 (a kernel this Triton cannot build: the reference runs instead)
        kernel_failed("tree_compact", e)
        return False
    return True


if HAVE_TRITON:
    @triton.jit
    def _compact_kernel(KV, TABLES, ROOT, PATH, ACC, M, s_part, BS: tl.constexpr, D: tl.constexpr, W: tl.constexpr,
                        BW: tl.constexpr, PDL: tl.constexpr):
        pdl_begin(PDL)
        pdl_wait(PDL)
        row = tl.program_id(0).to(tl.int64)
        part = KV + tl.program_id(1).to(tl.int64) * s_part  # one layer's keys or values [blocks * BS, W]
        e = tl.arange(0, BW)
        root = tl.load(ROOT + row)
        acc = tl.load(ACC + row)
        for i in range(1, D + 1):
            if i <= acc:
                src = root + tl.load(PATH + row * D + i - 1)
                dst = root + i
                s_blk = tl.load(TABLES + row * M + tl.minimum(src // BS, M - 1))
                d_blk = tl.load(TABLES + row * M + tl.minimum(dst // BS, M - 1))
                x = tl.load(part + (s_blk * BS + src % BS) * W + e, mask=e < W)
                tl.store(part + (d_blk * BS + dst % BS) * W + e, x, mask=e < W)

    @triton.jit
    def _match(ARGMAX, NODES, PARENTS, row, col, nn, can, N: tl.constexpr):
        """Whether node column ``col`` [BN] (>= 1) is a valid node whose token is the argmax at its parent."""
        live = (col >= 1) & (col <= nn) & can
        par = tl.load(PARENTS + row * N + col - 1, mask=live, other=0)
        live = live & (par >= 0) & (par < col)  # a parent precedes its node (a stale one reads nothing)
        tok = tl.load(NODES + row * N + col - 1, mask=live, other=-1)
        tgt = tl.load(ARGMAX + row * (N + 1) + par, mask=live, other=-2)
        return live & (tok == tgt)

    @triton.jit
    def _tree_accept_kernel(ARGMAX, NODES, PARENTS, NUM, CAN, OUT, N: tl.constexpr, D: tl.constexpr,
                            BN: tl.constexpr, BE: tl.constexpr, PDL: tl.constexpr):
        pdl_begin(PDL)
        pdl_wait(PDL)
        row = tl.program_id(0).to(tl.int64)
        col = tl.arange(0, BN).to(tl.int64)  # [BN] columns: 0 the root, 1..N the nodes
        nn = tl.minimum(tl.load(NUM + row), N)
        can = tl.load(CAN + row) != 0
        # ok: every node from the column up to the root matches; dep: the column's depth
        ok = col <= N
        dep = tl.zeros([BN], tl.int64)
        cur = col
        for _ in range(D):
            up = cur >= 1
            ok = ok & (~up | _match(ARGMAX, NODES, PARENTS, row, cur, nn, can, N))
            dep += up.to(tl.int64)
            cur = tl.load(PARENTS + row * N + cur - 1, mask=up & (cur <= N), other=0)
        key = tl.where(ok, dep, -1)
        accepted = tl.max(key, axis=0)
        best = tl.min(tl.where(key == accepted, col, BN), axis=0)  # the first column of the deepest
        bonus = tl.load(ARGMAX + row * (N + 1) + best)
        # the path: best and its ancestors below the root
        on = col < 0
        b = best
        for _ in range(D):
            on = on | ((col == b) & (b >= 1))
            b = tl.load(PARENTS + row * N + b - 1, mask=(b >= 1) & (b <= N), other=0)
        tok = tl.load(NODES + row * N + col - 1, mask=(col >= 1) & (col <= N), other=0)
        j = tl.arange(0, BE).to(tl.int64)  # [BE] depth index: path[j] is the node at depth j + 1
        sel = on[None, :] & (dep[None, :] == j[:, None] + 1)  # [BE, BN]
        path = tl.sum(tl.where(sel, col[None, :], 0), axis=1)
        toks = tl.sum(tl.where(sel, tok[None, :], 0), axis=1)
        emitted = tl.where(j < accepted, toks, tl.where(j == accepted, bonus, 0))
        base = OUT + row * (2 * D + 2)
        tl.store(base, accepted)
        tl.store(base + 1 + j, path, mask=j < D)
        tl.store(base + 1 + D + j, emitted, mask=j <= D)
