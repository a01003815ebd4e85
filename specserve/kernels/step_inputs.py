"""A graph step's inputs from its record (``specserve.runner.graph_inputs``) in one kernel.

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
