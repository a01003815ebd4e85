"""A graph step's inputs from its record (``specserve.runner.graph_inputs``) in one kernel; under the overlap scheduler
one more kernel before it corrects the rows that continue the step in flight (``correct_record``).

Per row: positions, cache slots, flat indices, row / column of every token and the row's last token; for
speculation also the verified positions, the drafts, the draft loop's token table and the acceptance flags
as booleans. PyTorch takes about 16 small kernels for a plain step and 36 for a speculative one (each 1-2 µs
on the H200, inside the graph); the reference below is those ops, and the CPU path.
"""

from __future__ import annotations

import torch

from specserve.cache.kv_cache import PAD_BLOCK
from specserve.kernels import kernel_failed, kernel_usable, use_triton

from specserve.kernels._triton import HAVE_TRITON, tl, triton

LAYOUT = ("positions", "slots", "flat", "row_of_token", "col_of_token", "last")  # [B, q] x 5, then [B]
SPEC = ("base_col", "t0", "verify_idx", "drafts", "ext", "flags")  # [B] x 2, [B, D+1], [B, D], [B, q+D+2], [4, B]


def expand_record_ref(start, count, nd, tokens, tables, block_size: int, draft_len: int | None = None,
                      flags: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """start, count, nd [B]; tokens [B, q]; tables [B, M] (int64) -> the LAYOUT tensors and, with
    ``draft_len`` (D), the SPEC ones (``flags`` [4, B] int64 -> bool)."""
    b, q = tokens.shape
    col = torch.arange(q, device=tokens.device)  # [q]
    real = col < count[:, None]  # [B, q]
    pos = torch.where(real, start[:, None] + col, col)  # [B, q]; padding sits at its column
    blk = torch.where(real, tables.gather(1, torch.where(real, pos // block_size, 0)), PAD_BLOCK)  # [B, q]
    flat = torch.arange(b * q, device=tokens.device).view(b, q)
    out = dict(positions=pos, slots=blk * block_size + pos % block_size, flat=flat,
               row_of_token=flat // q, col_of_token=col.expand(b, q), last=flat[:, 0] + count - 1)
    if draft_len is None:
        return out
    d = draft_len
    base_col = count - 1 - nd  # [B]: column of the last known token
    t0 = flat[:, 0]  # [B]
    j = torch.arange(d + 1, device=tokens.device)
    verify_idx = t0[:, None] + torch.minimum(base_col[:, None] + j, (count - 1)[:, None])  # [B, D+1]
    k = j[:d]
    dcol = torch.clamp(base_col[:, None] + 1 + k, max=q - 1)  # [B, D]
    drafts = torch.where(k < nd[:, None], tokens.gather(1, dcol), 0)
    ext = torch.nn.functional.pad(tokens, (0, d + 2))  # [B, q + D + 2]
    out.update(base_col=base_col, t0=t0, verify_idx=verify_idx, drafts=drafts, ext=ext, flags=flags != 0)
    return out


def node_depths(parents: torch.Tensor, depth: int) -> torch.Tensor:
    """parents [B, N] (columns, 0 the root) -> depth of every column [B, N+1] (the root 0; nodes <= ``depth``)."""
    b, n = parents.shape
    d = torch.zeros(b, n + 1, dtype=torch.int64, device=parents.device)
    for _ in range(depth):
        d[:, 1:] = d.gather(1, parents) + 1
    return d


def correct_record_ref(f: dict[str, torch.Tensor], tokens: torch.Tensor, carry: torch.Tensor, draft_len: int,
                       thinking_tokens: tuple[int, int] = (-1, -1), num_nodes: int | None = None) -> None:
    """Inside a generation step under the overlap scheduler, before its record is expanded: the rows that continue
    the step in flight (``src`` >= 0, ``runner/overlap.py``) corrected in place from that step's result rows
    ``carry`` [columns + 1, C] (``StepCarry.buf``). ``f``: the record's device views (start, count, offsets, src
    [B]; speculating num_drafts, prev_nd, room, cap [B], flags [4 * B]; a tree's parents [B * N]); tokens [B, q],
    q = 1 + N (N: ``num_nodes``, a tree's; a chain's D), or narrower (a tree engine's layout of chains alone).
    Plain: the token is the sampled one (``carry`` may be a view of a wider buffer's columns: rows are read by its
    stride). Speculating: a =
    accepted of prev_nd, delta = prev_nd - a; start and offsets move back by delta; the drafts kept are those of
    depth <= clamp(room + delta, 0, D) (a chain's first that many; a tree's a prefix, sorted by depth), at most
    cap; tokens = the bonus (the a-th emitted token), then the drafts (a tree's parents from the carry too); the
    thinking phase follows the emitted tokens (the last begin / end token wins)."""
    src = f["src"]
    dep = src >= 0  # [B]
    c = carry[src.clamp(min=0)]  # [B, C]
    if not draft_len:
        tokens[:, 0] = torch.where(dep, c[:, 0], tokens[:, 0])
        return
    d = draft_len
    n = num_nodes or d
    a = c[:, 0].clamp(0, d)  # [B]
    delta = torch.where(dep, f["prev_nd"] - a, 0)  # [B]
    limit = (f["room"] + delta).clamp(0, d)  # [B]: the deepest drafts that fit
    k = torch.arange(n, device=tokens.device)
    if num_nodes:  # carry rows: accepted, D + 1 emitted, N nodes, N parents
        par = c[:, d + 2 + n:d + 2 + 2 * n]  # [B, N]
        # [B, N]; a chain's unused nodes hang below its last, past the drafts its step proposed, which ``cap`` holds
        depth = node_depths(par, d + 1)[:, 1:]
        count = (depth <= limit[:, None]).sum(dim=1)
    else:
        count = limit
    nd = torch.where(dep, torch.minimum(count, f["cap"]), f["num_drafts"])  # [B]
    emitted = c[:, 1:d + 2]  # [B, D+1]
    new = torch.cat([emitted.gather(1, a[:, None]), torch.where(k < nd[:, None], c[:, d + 2:d + 2 + n], 0)], 1)
    w = min(n + 1, tokens.shape[1])  # a tree engine's layout of chains alone is narrower than 1 + N
    tokens[:, :w] = torch.where(dep[:, None], new[:, :w], tokens[:, :w])
    if num_nodes:
        parents = f["parents"].view(-1, n)
        parents.copy_(torch.where(dep[:, None], torch.where(k < nd[:, None], par, 0), parents))
    f["start"].sub_(delta)
    f["offsets"].sub_(delta)
    f["count"].copy_(torch.where(dep, 1 + nd, f["count"]))
    f["num_drafts"].copy_(nd)
    begin, end = thinking_tokens
    if begin >= 0 or end >= 0:
        flags = f["flags"].view(4, -1)
        j = torch.arange(d + 1, device=tokens.device)
        valid = j <= a[:, None]  # [B, D+1]: the emitted tokens
        last_b = torch.where(valid & (emitted == begin), j, -1).amax(1)
        last_e = torch.where(valid & (emitted == end), j, -1).amax(1)
        th = torch.where(last_b > last_e, 1, torch.where(last_e > last_b, 0, flags[3]))
        flags[3] = torch.where(dep, th, flags[3])


def correct_record(f: dict[str, torch.Tensor], tokens: torch.Tensor, carry: torch.Tensor, draft_len: int,
                   thinking_tokens: tuple[int, int] = (-1, -1), num_nodes: int | None = None) -> None:
    """As ``correct_record_ref``, in one kernel on CUDA."""
    if not use_triton(tokens) or not kernel_usable("correct_record"):
        return correct_record_ref(f, tokens, carry, draft_len, thinking_tokens, num_nodes)
    b, q = tokens.shape
    d = draft_len
    n = num_nodes or d
    spec = d > 0
    tree = bool(num_nodes)
    src = f["src"]
    none = src  # a pointer the kernel never reads where an input is absent (a plain step)
    begin, end = thinking_tokens
    try:
        _correct_record_kernel[(b,)](
            src, tokens, carry, f["start"] if spec else none, f["count"] if spec else none,
            f["num_drafts"] if spec else none, f["offsets"] if spec else none, f["prev_nd"] if spec else none,
            f["room"] if spec else none, f["cap"] if spec else none, f["flags"] if spec else none,
            f["parents"] if tree else none, b, q, carry.stride(0), SPEC=spec, TREE=tree, D=d, N=n,
            N_BLOCK=triton.next_power_of_2(n + 1), D_BLOCK=triton.next_power_of_2(d + 1), BEGIN=begin, END=end,
            THINK=spec and (begin >= 0 or end >= 0))
    except Exception as e:  # not built here (first launch; never inside a capture): the reference ops
        kernel_failed("correct_record", e)
        correct_record_ref(f, tokens, carry, draft_len, thinking_tokens, num_nodes)


def expand_record(start, count, nd, tokens, tables, block_size: int, draft_len: int | None = None,
                  flags: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """As ``expand_record_ref``, in one kernel on CUDA."""
    if not use_triton(tokens) or not kernel_usable("expand_record"):
        return expand_record_ref(start, count, nd, tokens, tables, block_size, draft_len, flags)
    b, q = tokens.shape
    m = tables.shape[1]
    dev = tokens.device
    spec = draft_len is not None
    d = draft_len or 0
    lay = torch.empty(5, b, q, dtype=torch.int64, device=dev)
    last = torch.empty(b, dtype=torch.int64, device=dev)
    ints = torch.empty(2, b, dtype=torch.int64, device=dev) if spec else last
    vidx = torch.empty(b, d + 1, dtype=torch.int64, device=dev) if spec else last
    drafts = torch.empty(b, d, dtype=torch.int64, device=dev) if spec else last
    w = q + d + 2
    ext = torch.empty(b, w, dtype=torch.int64, device=dev) if spec else last
    bflags = torch.empty(4, b, dtype=torch.bool, device=dev) if spec else last
    flags = flags if spec else last
    try:
        _expand_record_kernel[(b,)](
            start, count, nd, tokens, tables, flags, lay, last, ints, vidx, drafts, ext, bflags, b, q, m, w,
            BS=block_size, PAD=PAD_BLOCK, Q_BLOCK=triton.next_power_of_2(q), SPEC=spec, D=d,
            D_BLOCK=triton.next_power_of_2(d + 1), W_BLOCK=triton.next_power_of_2(w))
    except Exception as e:  # not built here (first launch; never inside a capture): the reference ops
        kernel_failed("expand_record", e)
        return expand_record_ref(start, count, nd, tokens, tables, block_size, draft_len, flags)
    out = dict(zip(LAYOUT[:5], lay.unbind(0)), last=last)
    if spec:
        out.update(base_col=ints[0], t0=ints[1], verify_idx=vidx, drafts=drafts, ext=ext, flags=bflags)
    return out


if HAVE_TRITON:
    @triton.jit
    def _correct_record_kernel(SRC, TOK, CARRY, START, COUNT, ND, OFFSETS, PREV, ROOM, CAP, FLAGS, PAR, B, Q, C,
                               SPEC: tl.constexpr, TREE: tl.constexpr, D: tl.constexpr, N: tl.constexpr,
                               N_BLOCK: tl.constexpr, D_BLOCK: tl.constexpr, BEGIN: tl.constexpr, END: tl.constexpr,
                               THINK: tl.constexpr):
        r = tl.program_id(0).to(tl.int64)
        src = tl.load(SRC + r)
        if src >= 0:
            row = CARRY + src * C
            if SPEC:
                a = tl.minimum(tl.maximum(tl.load(row), 0), D)
                delta = tl.load(PREV + r) - a
                limit = tl.minimum(tl.maximum(tl.load(ROOM + r) + delta, 0), D)
                k = tl.arange(0, N_BLOCK).to(tl.int64)  # node k (column k + 1)
                km = k < N
                if TREE:  # each node's depth: the steps up its parents to the root
                    par = tl.load(row + D + 2 + N + k, mask=km, other=0)
                    cur = k + 1
                    depth = k * 0
                    for _ in range(D + 1):  # a chain's unused nodes hang below it, past ``cap``
                        up = cur > 0
                        depth += up.to(tl.int64)
                        cur = tl.where(up, tl.load(row + D + 1 + N + cur, mask=km & up, other=0), 0)
                    count = tl.sum((km & (depth <= limit)).to(tl.int64), axis=0)
                else:
                    count = limit
                nd = tl.minimum(count, tl.load(CAP + r))
                bonus = tl.load(row + 1 + a)
                j = k  # token column j: the bonus at 0, node j - 1 after it
                node = tl.load(row + D + 1 + j, mask=(j >= 1) & (j <= nd), other=0)
                tl.store(TOK + r * Q + j, tl.where(j == 0, bonus, node), mask=(j <= N) & (j < Q))
                if TREE:
                    tl.store(PAR + r * N + k, tl.where(k < nd, par, 0), mask=km)
                tl.store(START + r, tl.load(START + r) - delta)
                tl.store(OFFSETS + r, tl.load(OFFSETS + r) - delta)
                tl.store(COUNT + r, 1 + nd)
                tl.store(ND + r, nd)
                if THINK:
                    e = tl.arange(0, D_BLOCK).to(tl.int64)
                    emitted = tl.load(row + 1 + e, mask=e <= a, other=-1)
                    last_b = tl.max(tl.where((emitted == BEGIN) & (e <= a), e, -1), axis=0)
                    last_e = tl.max(tl.where((emitted == END) & (e <= a), e, -1), axis=0)
                    th = tl.load(FLAGS + 3 * B + r)
                    th = tl.where(last_b > last_e, 1, tl.where(last_e > last_b, 0, th))
                    tl.store(FLAGS + 3 * B + r, th)
            else:
                tl.store(TOK + r * Q, tl.load(row))

    @triton.jit
    def _expand_record_kernel(START, COUNT, ND, TOK, TAB, FLAGS, LAY, LAST, INTS, VIDX, DRAFTS, EXT, BFLAGS,
                              B, Q, M, W, BS: tl.constexpr, PAD: tl.constexpr, Q_BLOCK: tl.constexpr,
                              SPEC: tl.constexpr, D: tl.constexpr, D_BLOCK: tl.constexpr, W_BLOCK: tl.constexpr):
        r = tl.program_id(0).to(tl.int64)
        start = tl.load(START + r)
        count = tl.load(COUNT + r)
        c = tl.arange(0, Q_BLOCK).to(tl.int64)
        cm = c < Q
        real = c < count
        pos = tl.where(real, start + c, c)
        blk = tl.load(TAB + r * M + pos // BS, mask=cm & real, other=PAD)
        blk = tl.where(real, blk, PAD)
        flat = r * Q + c
        plane = B * Q  # elements per [B, q] output
        tl.store(LAY + flat, pos, mask=cm)
        tl.store(LAY + plane + flat, blk * BS + pos % BS, mask=cm)
        tl.store(LAY + 2 * plane + flat, flat, mask=cm)
        tl.store(LAY + 3 * plane + flat, r + c * 0, mask=cm)
        tl.store(LAY + 4 * plane + flat, c, mask=cm)
        t0 = r * Q
        tl.store(LAST + r, t0 + count - 1)
        if SPEC:
            nd = tl.load(ND + r)
            base_col = count - 1 - nd
            tl.store(INTS + r, base_col)
            tl.store(INTS + B + r, t0)
            j = tl.arange(0, D_BLOCK).to(tl.int64)
            tl.store(VIDX + r * (D + 1) + j, t0 + tl.minimum(base_col + j, count - 1), mask=j < D + 1)
            km = j < D
            dcol = tl.minimum(base_col + 1 + j, Q - 1)
            tok = tl.load(TOK + r * Q + dcol, mask=km & (j < nd), other=0)
            tl.store(DRAFTS + r * D + j, tok, mask=km)
            e = tl.arange(0, W_BLOCK).to(tl.int64)
            et = tl.load(TOK + r * Q + e, mask=e < Q, other=0)
            tl.store(EXT + r * W + e, et, mask=e < W)
            f = tl.arange(0, 4).to(tl.int64)
            fl = tl.load(FLAGS + f * B + r)
            tl.store(BFLAGS + f * B + r, fl != 0)
