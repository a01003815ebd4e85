"""What the draft loop reads after acceptance, in one kernel.

From each row's accepted count: the draft table with the bonus token written after the last accepted
position, the last accepted column / flat index / position, the token each verified position's head input
takes (the one after it, bonus included), and the positions and cache slots of chain steps 1 .. D-1. PyTorch
takes about 25 small kernels for these (each 1-2 µs inside an H200 graph); the reference below is those ops,
and the CPU path.
"""

from __future__ import annotations

import torch

from specserve.cache.kv_cache import PAD_BLOCK
from specserve.kernels import kernel_failed, kernel_usable, use_triton
from specserve.kernels.pdl import kernel_args

from specserve.kernels._triton import HAVE_TRITON, tl, triton

if HAVE_TRITON:
    from specserve.kernels.pdl import pdl_begin, pdl_wait


def draft_inputs_ref(accepted, emitted, base_col, t0, start, ext, draft_ok, tables, row_of_token, col_of_token,
                     block_size: int, draft_len: int, max_pos: int) -> dict[str, torch.Tensor]:
    """accepted, base_col, t0, start [B] int64; emitted [B, D+1]; ext [B, W] (the step's tokens by row); draft_ok
    [B] bool; tables [B, M]; row_of_token, col_of_token [T] -> ext [B, W] (bonus at last_col + 1 of drafting
    rows), last_col, last_idx, last_pos [B], ids0 [T] (the token after each one), chain_pos, chain_slot [K, B]
    (K = max(1, D - 1); step k writes at last_pos + k, clamped to ``max_pos``; rows that do not draft write the
    pad block)."""
    b = accepted.shape[0]
    rows = torch.arange(b, device=accepted.device)
    last_col = base_col + accepted  # [B]
    ext = ext.clone()
    bonus = emitted[rows, accepted]
    ext[rows, last_col + 1] = torch.where(draft_ok, bonus, ext[rows, last_col + 1])
    last_pos = start + last_col
    ks = torch.arange(1, max(2, draft_len), device=accepted.device)  # [K]
    pos = torch.clamp(last_pos[:, None] + ks, max=max_pos)  # [B, K]
    blk = tables.gather(1, torch.clamp(pos // block_size, max=tables.shape[1] - 1))
    slot = torch.where(draft_ok[:, None], blk * block_size + pos % block_size, PAD_BLOCK * block_size)
    return dict(ext=ext, last_col=last_col, last_idx=t0 + last_col, last_pos=last_pos,
                ids0=ext[row_of_token, col_of_token + 1], chain_pos=pos.t().contiguous(),
                chain_slot=slot.t().contiguous())


BLOCK_T = 256  # tokens per program of the token part


def draft_inputs(accepted, emitted, base_col, t0, start, ext, draft_ok, tables, row_of_token, col_of_token,
                 block_size: int, draft_len: int, max_pos: int) -> dict[str, torch.Tensor]:
    """As ``draft_inputs_ref``, in one kernel on CUDA: B programs for the rows, then one per BLOCK_T tokens."""
    args = (accepted, emitted, base_col, t0, start, ext, draft_ok, tables, row_of_token, col_of_token)
    if not use_triton(ext) or not kernel_usable("draft_inputs"):
        return draft_inputs_ref(*args, block_size, draft_len, max_pos)
    b, w = ext.shape
    t = row_of_token.shape[0]
    k = max(1, draft_len - 1)
    dev = ext.device
    ext_out = torch.empty_like(ext)
    rows3 = torch.empty(3, b, dtype=torch.int64, device=dev)  # last_col, last_idx, last_pos
    ids0 = torch.empty(t, dtype=torch.int64, device=dev)
    chain = torch.empty(2, k, b, dtype=torch.int64, device=dev)  # positions, slots
    # emitted is read through its strides (the step's result rows: [B, D+1] with strides 1, B); the rest contiguous
    contig = [x if i == 1 else x.contiguous() for i, x in enumerate(args)]
    try:
        _draft_inputs_kernel[(b + triton.cdiv(t, BLOCK_T),)](
            *contig, ext_out, rows3, ids0, chain, b, w, t, tables.shape[1], k, max_pos, *emitted.stride(),
            BS=block_size, PAD=PAD_BLOCK, W_BLOCK=triton.next_power_of_2(w), K_BLOCK=triton.next_power_of_2(k),
            BLOCK_T=BLOCK_T, **kernel_args(ext))
    except Exception as e:  # not built here (first launch; never inside a capture): the reference ops
        kernel_failed("draft_inputs", e)
        return draft_inputs_ref(*args, block_size, draft_len, max_pos)
    return dict(ext=ext_out, last_col=rows3[0], last_idx=rows3[1], last_pos=rows3[2], ids0=ids0,
                chain_pos=chain[0], chain_slot=chain[1])


if HAVE_TRITON:
    @triton.jit
    def _draft_inputs_kernel(ACC, EMIT, BASE, T0, START, EXT, OK, TAB, ROW, COL, EXT_OUT, ROWS3, IDS0, CHAIN,
                             B, W, T, M, K, MAX_POS, s_emit, s_ec, BS: tl.constexpr, PAD: tl.constexpr,
                             W_BLOCK: tl.constexpr, K_BLOCK: tl.constexpr, BLOCK_T: tl.constexpr,
                             PDL: tl.constexpr):
        pdl_begin(PDL)
        pdl_wait(PDL)
        p = tl.program_id(0).to(tl.int64)
        if p < B:  # row p: the draft table, the last accepted token, the chain's positions and slots
            acc = tl.load(ACC + p)
            lc = tl.load(BASE + p) + acc
            ok = tl.load(OK + p) != 0
            bonus = tl.load(EMIT + p * s_emit + acc * s_ec)
            e = tl.arange(0, W_BLOCK).to(tl.int64)
            x = tl.load(EXT + p * W + e, mask=e < W, other=0)
            tl.store(EXT_OUT + p * W + e, tl.where(ok & (e == lc + 1), bonus, x), mask=e < W)
            last_pos = tl.load(START + p) + lc
            tl.store(ROWS3 + p, lc)
            tl.store(ROWS3 + B + p, tl.load(T0 + p) + lc)
            tl.store(ROWS3 + 2 * B + p, last_pos)
            k = tl.arange(0, K_BLOCK).to(tl.int64)
            km = k < K
            pos = tl.minimum(last_pos + 1 + k, MAX_POS)
            blk = tl.load(TAB + p * M + tl.minimum(pos // BS, M - 1), mask=km, other=0)
            slot = tl.where(ok, blk * BS + pos % BS, PAD * BS)
            tl.store(CHAIN + k * B + p, pos, mask=km)
            tl.store(CHAIN + K * B + k * B + p, slot, mask=km)
        else:  # tokens: the head's input token after each verified one (the bonus where it was written)
            # (names apart from the row branch's: Triton types a name across both branches of a runtime `if`)
            t = (p - B) * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
            tm = t < T
            row = tl.load(ROW + t, mask=tm, other=0)
            col = tl.load(COL + t, mask=tm, other=0)
            t_acc = tl.load(ACC + row, mask=tm, other=0)
            t_lc = tl.load(BASE + row, mask=tm, other=0) + t_acc
            t_ok = tl.load(OK + row, mask=tm, other=0) != 0
            t_bonus = tl.load(EMIT + row * s_emit + t_acc * s_ec, mask=tm, other=0)
            t_x = tl.load(EXT + row * W + col + 1, mask=tm, other=0)
            tl.store(IDS0 + t, tl.where(t_ok & (col == t_lc), t_bonus, t_x), mask=tm)
