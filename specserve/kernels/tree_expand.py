"""One depth of a draft tree's expansion in two kernels (``expand_depth_ref`` is their reference).

Each frontier node's head logits give its ``k`` most likely children (log-probabilities over the head's
vocabulary); a child's score is its parent's plus its own; the ``k`` best children of a row become the next
frontier, whose hidden states and ancestor bits are their parents'. In PyTorch that is a log-softmax, a radix
top-k of six to eight kernels per call, a sort-based top-k over the children and half a dozen gathers; here the
first kernel reduces each block of the vocabulary to its own top-k and softmax partial sums, the second merges the
blocks, scores the children, picks the frontier and gathers its states.

Ties go to the lower index, in both top-k choices (the reference sorts stably), so the kernels and the reference
pick the same children.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.kernels import kernel_failed, kernel_usable, use_triton
from specserve.kernels._triton import HAVE_TRITON, tl, triton
from specserve.kernels.pdl import kernel_args


def select_tree_ref(tok: torch.Tensor, par: torch.Tensor, score: torch.Tensor, depth: torch.Tensor,
                    n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Candidates [B, C] (token, parent's candidate id or -1 for the root, cumulative score, depth) -> the ``n``
    of highest score as the next tree's nodes and parent columns [B, n], sorted by depth, then score (ties: the
    lower candidate id)."""
    # a child scores at most its parent: the depth term breaks a tie in the parent's favour
    key = score - 1e-6 * depth
    top = topk_stable(key, n)[1]  # [B, N]
    d = depth.gather(1, top)
    order = torch.sort(d, dim=-1, stable=True).indices  # by depth, keeping the score order within one
    sel = top.gather(1, order)  # [B, N] candidate ids in column order
    col_of = torch.zeros_like(tok)  # [B, C] column of each selected candidate (its parent is selected too)
    col_of.scatter_(1, sel, torch.arange(1, n + 1, device=tok.device).expand_as(sel))
    p = par.gather(1, sel)
    parents = torch.where(p < 0, 0, col_of.gather(1, p.clamp(min=0)))
    return tok.gather(1, sel), parents


def select_tree(tok: torch.Tensor, par: torch.Tensor, score: torch.Tensor, depth: torch.Tensor,
                n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``select_tree_ref`` in one kernel on the GPU (a program a row)."""
    if not use_triton(tok) or not kernel_usable("tree_select"):
        return select_tree_ref(tok, par, score, depth, n)
    b, c = tok.shape
    nodes = torch.empty(b, n, dtype=torch.int64, device=tok.device)
    parents = torch.empty(b, n, dtype=torch.int64, device=tok.device)
    ins = [x.contiguous() for x in (tok, par, score)]
    depth = depth.expand(b, c)
    if depth.stride(1) != 1:
        depth = depth.contiguous()
    try:
        _select_kernel[(b,)](*ins, depth, nodes, parents, c, depth.stride(0), N=n, NP=triton.next_power_of_2(n),
                             CP=triton.next_power_of_2(c), **kernel_args(tok))
    except Exception as e:  # noqa: BLE001 (a kernel this Triton cannot build: the reference runs instead)
        kernel_failed("tree_select", e)
        return select_tree_ref(tok, par, score, depth, n)
    return nodes, parents

if HAVE_TRITON:
    from specserve.kernels.pdl import pdl_begin, pdl_wait

VOCAB_BLOCK = 2048  # vocabulary entries a program of the first kernel reduces


@dataclass
class Frontier:
    """The nodes a depth expands: k a row (one, the root, before the first depth)."""

    tok: torch.Tensor  # [B, k] int64 target token ids
    score: torch.Tensor  # [B, k] float32 cumulative draft log-probabilities
    ids: torch.Tensor  # [B, k] int64 candidate ids (-1: the root)
    bits: torch.Tensor  # [B, k] int64 ancestor bits of the scratch columns (``TreeSpeculator.expand``)
    hidden: torch.Tensor  # [B, k, H] the head outputs the children are drafted from


def topk_stable(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., N] -> the k largest values and their indices [..., k], ties to the lower index."""
    v, i = torch.sort(x, dim=-1, descending=True, stable=True)
    return v[..., :k], i[..., :k]


def expand_depth_ref(logits: torch.Tensor, parent: Frontier, k: int, ids_map: torch.Tensor | None, next_id: int,
                     cand_tok: torch.Tensor, cand_score: torch.Tensor, cand_par: torch.Tensor) -> Frontier:
    """logits [B * KF, V'] of the KF frontier nodes of each of B rows (``parent``; their ``tok`` is not read) ->
    the next frontier of k nodes a row; the KF * k children are written as candidates ``next_id`` on of
    cand_tok, cand_score, cand_par [B, C] (token, cumulative score, parent's candidate id)."""
    b, kf = parent.score.shape
    lp = logits.float().log_softmax(dim=-1)  # [B * KF, V']
    s, i = topk_stable(lp, k)  # [B * KF, k]
    score = (parent.score[..., None] + s.view(b, kf, k)).reshape(b, kf * k)
    tok = (i if ids_map is None else ids_map[i]).reshape(b, kf * k)
    end = next_id + kf * k
    cand_tok[:, next_id:end] = tok
    cand_score[:, next_id:end] = score
    cand_par[:, next_id:end] = parent.ids.repeat_interleave(k, dim=1)
    _, pick = topk_stable(score, k)  # [B, k]
    up = pick // k  # each pick's parent among the frontier
    h = parent.hidden
    return Frontier(tok=tok.gather(1, pick), score=score.gather(1, pick), ids=next_id + pick,
                    bits=parent.bits.gather(1, up), hidden=h.gather(1, up[..., None].expand(b, k, h.shape[-1])))


def expand_depth(logits: torch.Tensor, parent: Frontier, k: int, ids_map: torch.Tensor | None, next_id: int,
                 cand_tok: torch.Tensor, cand_score: torch.Tensor, cand_par: torch.Tensor) -> Frontier:
    """``expand_depth_ref`` in two kernels on the GPU."""
    if (not use_triton(logits) or not kernel_usable("tree_expand")
            or not all(x.is_contiguous() for x in (cand_tok, cand_score, cand_par))):
        return expand_depth_ref(logits, parent, k, ids_map, next_id, cand_tok, cand_score, cand_par)
    b, kf = parent.score.shape
    rows, v = logits.shape
    h = parent.hidden.shape[-1]
    dev = logits.device
    nc = triton.cdiv(v, VOCAB_BLOCK)
    kp = triton.next_power_of_2(k)
    part_v = torch.empty(rows, nc, kp, dtype=torch.float32, device=dev)
    part_i = torch.empty(rows, nc, kp, dtype=torch.int64, device=dev)
    part_ms = torch.empty(2, rows, nc, dtype=torch.float32, device=dev)
    out = Frontier(tok=torch.empty(b, k, dtype=torch.int64, device=dev),
                   score=torch.empty(b, k, dtype=torch.float32, device=dev),
                   ids=torch.empty(b, k, dtype=torch.int64, device=dev),
                   bits=torch.empty(b, k, dtype=torch.int64, device=dev),
                   hidden=torch.empty(b, k, h, dtype=parent.hidden.dtype, device=dev))
    logits = logits.contiguous()
    src = [x.contiguous() for x in (parent.score, parent.ids, parent.bits, parent.hidden)]
    ids = ids_map if ids_map is not None else part_i  # never read without a map
    try:
        _vocab_topk_kernel[(rows, nc)](logits, part_v, part_i, part_ms, v, nc, K=k, KP=kp, BLOCK=VOCAB_BLOCK,
                                       **kernel_args(logits))
        _frontier_kernel[(b,)](part_v, part_i, part_ms, *src, ids, cand_tok, cand_score, cand_par, out.tok,
                               out.score, out.ids, out.bits, out.hidden, rows, nc, h, cand_tok.shape[1], next_id,
                               KF=kf, KFP=triton.next_power_of_2(kf), K=k, KP=kp,
                               NCP=triton.next_power_of_2(nc), MAP=ids_map is not None,
                               BLOCK_H=min(1024, triton.next_power_of_2(h)), **kernel_args(logits))
    except Exception as e:  # noqa: BLE001 (a kernel this Triton cannot build: the reference runs instead)
        kernel_failed("tree_expand", e)
        return expand_depth_ref(logits, parent, k, ids_map, next_id, cand_tok, cand_score, cand_par)
    return out


if HAVE_TRITON:
    @triton.jit
    def _vocab_topk_kernel(X, PV, PI, PMS, V, NC, K: tl.constexpr, KP: tl.constexpr, BLOCK: tl.constexpr,
                           PDL: tl.constexpr):
        """Program (row, block): the block's k largest logits and their indices (ties: the lower), its maximum
        and its sum of exp(x - maximum)."""
        pdl_begin(PDL)
        pdl_wait(PDL)
        r = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1)
        offs = c * BLOCK + tl.arange(0, BLOCK)
        live = offs < V
        x = tl.load(X + r * V + offs, mask=live, other=float("-inf")).to(tl.float32)
        m = tl.max(x, 0)
        s = tl.sum(tl.where(live, tl.exp(x - m), 0.0), 0)
        base = (r * NC + c) * KP
        for t in tl.static_range(K):
            best = tl.max(x, 0)
            at = tl.min(tl.where(live & (x == best), offs, V), 0)  # V: the block has no entry left
            tl.store(PV + base + t, best)
            tl.store(PI + base + t, tl.minimum(at, V - 1).to(tl.int64))
            x = tl.where(offs == at, float("-inf"), x)
        tl.store(PMS + r * NC + c, m)
        tl.store(PMS + (tl.num_programs(0) * NC) + r * NC + c, s)

    @triton.jit
    def _frontier_kernel(PV, PI, PMS, FSCORE, FID, FBITS, FH, IDS, CTOK, CSCORE, CPAR, OTOK, OSCORE, OID, OBITS,
                         OH, R, NC, H, C, NEXT, KF: tl.constexpr, KFP: tl.constexpr, K: tl.constexpr,
                         KP: tl.constexpr, NCP: tl.constexpr, MAP: tl.constexpr, BLOCK_H: tl.constexpr,
                         PDL: tl.constexpr):
        """Program b: row b's KF frontier nodes -> their k children each (candidates NEXT on) and the next
        frontier (the k best children, ties to the lower child index)."""
        pdl_begin(PDL)
        pdl_wait(PDL)
        b = tl.program_id(0).to(tl.int64)
        j = tl.arange(0, KFP)  # frontier nodes
        jm = j < KF
        rows = b * KF + j  # [KFP] their logits rows
        cc = tl.arange(0, NCP)
        cm = jm[:, None] & (cc[None, :] < NC)
        m = tl.load(PMS + rows[:, None] * NC + cc[None, :], mask=cm, other=float("-inf"))  # [KFP, NCP]
        s = tl.load(PMS + R * NC + rows[:, None] * NC + cc[None, :], mask=cm, other=0.0)
        mx = tl.where(jm, tl.max(m, 1), 0.0)  # padding nodes: 0, so that nothing below is inf - inf
        total = tl.sum(tl.where(cm, s * tl.exp(m - mx[:, None]), 0.0), 1)
        lse = tl.where(jm, mx + tl.log(tl.where(jm, total, 1.0)), 0.0)  # [KFP]
        # each node's candidates from every block, in index order (block, then rank)
        q = tl.arange(0, NCP * KP)
        qm = jm[:, None] & (q[None, :] < NC * KP) & ((q[None, :] % KP) < K)
        cv = tl.load(PV + rows[:, None] * (NC * KP) + q[None, :], mask=qm, other=float("-inf"))  # [KFP, NC*KP]
        fscore = tl.load(FSCORE + b * KF + j, mask=jm, other=0.0)
        fid = tl.load(FID + b * KF + j, mask=jm, other=0)
        t_of = tl.arange(0, KP)
        child_s = tl.full((KFP, KP), float("-inf"), tl.float32)
        child_t = tl.zeros((KFP, KP), dtype=tl.int64)
        for t in tl.static_range(K):
            best = tl.max(cv, 1)  # [KFP]
            # clamped: a NaN row matches nothing, and a wrong token beats a read out of bounds
            at = tl.minimum(tl.min(tl.where(cv == best[:, None], q[None, :], NCP * KP), 1), NC * KP - 1)
            tok = tl.load(PI + rows * (NC * KP) + at, mask=jm, other=0)
            if MAP:
                tok = tl.load(IDS + tok, mask=jm, other=0)
            sc = fscore + (best - lse)  # best <= lse: a child never scores above its parent, even rounded
            dst = b * C + NEXT + j * K + t
            tl.store(CTOK + dst, tok, mask=jm)
            tl.store(CSCORE + dst, sc, mask=jm)
            tl.store(CPAR + dst, fid, mask=jm)
            child_s = tl.where(t_of[None, :] == t, sc[:, None], child_s)
            child_t = tl.where(t_of[None, :] == t, tok[:, None], child_t)
            cv = tl.where(q[None, :] == at[:, None], float("-inf"), cv)
        # the next frontier: the k best children of the row, child index j * K + t
        cidx = j[:, None] * K + t_of[None, :]  # [KFP, KP]
        cvalid = jm[:, None] & (t_of[None, :] < K)
        child_s = tl.where(cvalid, child_s, float("-inf"))
        hs = tl.arange(0, BLOCK_H)
        for p in tl.static_range(K):
            best = tl.max(tl.max(child_s, 1), 0)
            at = tl.minimum(tl.min(tl.min(tl.where(cvalid & (child_s == best), cidx, KF * K), 1), 0), KF * K - 1)
            up = at // K
            tok = tl.sum(tl.sum(tl.where(cidx == at, child_t, 0), 1), 0)
            tl.store(OTOK + b * K + p, tok)
            tl.store(OSCORE + b * K + p, best)
            tl.store(OID + b * K + p, NEXT + at)
            tl.store(OBITS + b * K + p, tl.load(FBITS + b * KF + up))
            for h0 in range(0, H, BLOCK_H):
                hm = h0 + hs < H
                row = tl.load(FH + (b * KF + up) * H + h0 + hs, mask=hm)
                tl.store(OH + (b * K + p) * H + h0 + hs, row, mask=hm)
            child_s = tl.where(cidx == at, float("-inf"), child_s)

    @triton.jit
    def _select_kernel(TOK, PAR, SCORE, DEPTH, NODES, PARENTS, C, S_D, N: tl.constexpr, NP: tl.constexpr,
                       CP: tl.constexpr, PDL: tl.constexpr):
        """Program b: row b's n best candidates (score less 1e-6 a depth, ties to the lower id), each placed at
        column 1 + (the chosen of a lower depth) + (those of its depth chosen before it), with its parent's
        column."""
        pdl_begin(PDL)
        pdl_wait(PDL)
        b = tl.program_id(0).to(tl.int64)
        cs = tl.arange(0, CP)
        cm = cs < C
        dep = tl.load(DEPTH + b * S_D + cs, mask=cm, other=0)  # S_D 0: one row of depths for all
        key = tl.load(SCORE + b * C + cs, mask=cm, other=0.0) - 1e-6 * dep.to(tl.float32)
        key = tl.where(cm, key, float("-inf"))
        r = tl.arange(0, NP)
        sel = tl.zeros((NP,), dtype=tl.int64)
        for i in tl.static_range(N):
            best = tl.max(key, 0)
            at = tl.minimum(tl.min(tl.where(cm & (key == best), cs, CP), 0), C - 1)  # clamped as above
            sel = tl.where(r == i, at, sel)
            key = tl.where(cs == at, float("-inf"), key)
        live = r < N
        d = tl.load(DEPTH + b * S_D + sel, mask=live, other=0)  # [NP]
        # column of the i-th chosen: those chosen of a lower depth, or of its depth and chosen earlier, before it
        lower = d[None, :] < d[:, None]
        before = live[None, :] & (lower | ((d[None, :] == d[:, None]) & (r[None, :] < r[:, None])))
        col = 1 + tl.sum(before.to(tl.int64), 1)  # [NP]
        p = tl.load(PAR + b * C + sel, mask=live, other=-1)
        # the parent's column: the chosen candidate whose id is the parent's (a parent scores above its children)
        pc = tl.sum(tl.where(live[None, :] & (sel[None, :] == p[:, None]), col[None, :], 0), 1)
        t = tl.load(TOK + b * C + sel, mask=live, other=0)
        tl.store(NODES + b * N + col - 1, t, mask=live)
        tl.store(PARENTS + b * N + col - 1, tl.where(p < 0, 0, pc), mask=live)


__all__ = ["Frontier", "expand_depth", "expand_depth_ref", "select_tree", "select_tree_ref", "topk_stable"]
