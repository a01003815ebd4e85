"""The inputs of a tree step's draft step 0 in one kernel (``tree_draft_inputs_ref`` is its reference).

After acceptance each row's chain is its known tokens, the accepted path and the bonus. Draft step 0 runs the head
over every token of the step: token (row r, column c) on the chain reads the target state of the token it became
(a path node's column, moved after the root), sits at position start + c (its KV slot from the block table), and
takes the chain's next token as its input; tokens past the chain read their own state and write the pad slot. The
PyTorch version takes about thirty small kernels a step.
"""

from __future__ import annotations

import torch

from specserve.cache.kv_cache import PAD_BLOCK
from specserve.kernels import kernel_failed, kernel_usable, use_triton
from specserve.kernels._triton import HAVE_TRITON, tl, triton
from specserve.kernels.pdl import kernel_args

if HAVE_TRITON:
    from specserve.kernels.pdl import pdl_begin, pdl_wait


def tree_draft_inputs_ref(ext, base_col, ok, accepted, emitted, path, t0, start, row_of_token, col_of_token,
                          block_tables, block_size: int):
    """ext [B, W] (the rows' tokens from column 0, lookahead after a prompt chunk), base_col, ok, accepted, t0,
    start [B], emitted [B, D+1], path [B, D], row_of_token, col_of_token [T], block_tables [B, M] -> per token
    (src: the flat index of its target state, pos, slot, ids0: its head input token) [T] each."""
    dev = ext.device
    a = torch.where(ok, accepted, 0)
    chain_len = base_col + 1 + a  # [B]: the known tokens, then the path
    # the chain's tokens: the path's nodes and the bonus written after the root
    ext = ext.clone()
    j = torch.arange(emitted.shape[1], device=dev)
    cols = ((base_col + 1)[:, None] + j[None, :]).clamp(max=ext.shape[1] - 1)  # [B, D+1]
    put = ok[:, None] & (j[None, :] <= a[:, None])
    ext.scatter_(1, cols, torch.where(put, emitted, ext.gather(1, cols)))
    r, c = row_of_token, col_of_token  # [T]
    live = c < chain_len[r]
    off = c - base_col[r]  # >= 1 on the path
    path_col = path[r, (off - 1).clamp(0, path.shape[1] - 1)]  # [T]
    src = t0[r] + torch.where(off >= 1, base_col[r] + path_col, c)  # [T] the token's target state
    src = torch.where(live, src, torch.arange(r.shape[0], device=dev))
    pos = start[r] + c
    slot = block_tables[r, (pos // block_size).clamp(max=block_tables.shape[1] - 1)] * block_size + pos % block_size
    slot = torch.where(live, slot, PAD_BLOCK * block_size)
    ids0 = ext[r, (c + 1).clamp(max=ext.shape[1] - 1)]
    return src, pos, slot, ids0


def tree_draft_inputs(ext, base_col, ok, accepted, emitted, path, t0, start, row_of_token, col_of_token,
                      block_tables, block_size: int):
    """``tree_draft_inputs_ref``, one kernel on the GPU (a program a block of tokens)."""
    t = row_of_token.shape[0]
    if not use_triton(ext) or not kernel_usable("tree_draft_inputs") or t == 0:
        return tree_draft_inputs_ref(ext, base_col, ok, accepted, emitted, path, t0, start, row_of_token,
                                     col_of_token, block_tables, block_size)
    ins = [x.contiguous() for x in (ext, base_col, ok, accepted, emitted, path, t0, start, row_of_token,
                                   col_of_token, block_tables)]
    out = torch.empty(4, t, dtype=torch.int64, device=ext.device)
    block = 128
    try:
        _tree_draft_kernel[(triton.cdiv(t, block),)](
            *ins, out, t, ext.shape[1], path.shape[1], block_tables.shape[1], BS=block_size,
            PAD_SLOT=PAD_BLOCK * block_size, BLOCK=block, **kernel_args(ext))
    except Exception as e:  # noqa: BLE001 (a kernel this Triton cannot build: the reference runs instead)
        kernel_failed("tree_draft_inputs", e)
        return tree_draft_inputs_ref(ext, base_col, ok, accepted, emitted, path, t0, start, row_of_token,
                                     col_of_token, block_tables, block_size)
    return out[0], out[1], out[2], out[3]


if HAVE_TRITON:
    @triton.jit
    def _tree_draft_kernel(EXT, BASE, OK, ACC, EMIT, PATH, T0, START, ROW, COL, TABLES, OUT, T, W, D, M,
                           BS: tl.constexpr, PAD_SLOT: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
        pdl_begin(PDL)
        pdl_wait(PDL)
        t = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = t < T
        r = tl.load(ROW + t, mask=m, other=0)
        c = tl.load(COL + t, mask=m, other=0)
        bc = tl.load(BASE + r, mask=m, other=0)
        ok = tl.load(OK + r, mask=m, other=0) != 0
        a = tl.where(ok, tl.load(ACC + r, mask=m, other=0), 0)
        live = c < bc + 1 + a
        off = c - bc
        path_col = tl.load(PATH + r * D + tl.minimum(tl.maximum(off - 1, 0), D - 1), mask=m, other=0)
        src = tl.load(T0 + r, mask=m, other=0) + tl.where(off >= 1, bc + path_col, c)
        src = tl.where(live, src, t)
        pos = tl.load(START + r, mask=m, other=0) + c
        blk = tl.load(TABLES + r * M + tl.minimum(pos // BS, M - 1), mask=m, other=0)
        slot = tl.where(live, blk * BS + pos % BS, PAD_SLOT)
        # the head's input: the chain's next token, the path and bonus written after the root
        col = tl.minimum(c + 1, W - 1)
        jj = col - (bc + 1)  # its index among the emitted tokens
        hit = ok & (jj >= 0) & (jj <= a) & (jj <= D)
        ids0 = tl.where(hit, tl.load(EMIT + r * (D + 1) + jj, mask=m & hit, other=0),
                        tl.load(EXT + r * W + col, mask=m, other=0))
        tl.store(OUT + t, src, mask=m)
        tl.store(OUT + T + t, pos, mask=m)
        tl.store(OUT + 2 * T + t, slot, mask=m)
        tl.store(OUT + 3 * T + t, ids0, mask=m)
