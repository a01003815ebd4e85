"""Paged attention over the KV cache as one Triton kernel (plus a small combine kernel).

Layout (the one ``AttentionMetadata`` describes): row b's queries are the flat tokens
``query_index[b, :]`` (padding points at T) at positions ``query_pos[b, :]``; row b's key at position
j lives in block ``block_tables[b, j // block_size]``. A query at position p attends keys 0..p
(and only the last ``sliding_window`` of them when set).

Work split: one program per (row, query tile, KV head, key split). The query heads sharing a KV head
(GQA) and the queries of a tile are packed into the rows of one ``tl.dot``, so a verify step with 1 + D
queries costs about what a decode step costs. Keys are split in ranges of ``SPLIT`` positions so that a
batch of one still spreads over many SMs (flash-decoding); a split past a row's last position exits at
once, and a second kernel merges the splits' partial softmax sums. Up to ``ONE_SPLIT_KEYS`` key positions,
or where split partial sums would pass ``MAX_PARTIALS`` bytes (a prefill of many long prompts), one program
covers them all and writes the output itself: no partial buffers, no second launch (there a launch costs
more than splitting saves; past it, the sweep found the opposite). A small decode or verify step whose
consumer merges the splits without a kernel of its own (the o projection's prologue) splits a short table
too, in ``SHORT_SPLIT``-position splits (the launch rules: ``attention_launch.py``).
Positions are read on the device, so the launch shape depends only on host-known sizes and the step can be
captured in a CUDA graph.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from specserve.kernels.pdl import kernel_args

from specserve.kernels._triton import HAVE_TRITON, tl, triton
from specserve.kernels.attention_launch import TREE_WARPS, launch_shape, tree_verify_tiles

if HAVE_TRITON:
    from specserve.kernels.pdl import pdl_begin, pdl_wait

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# The merge kernel: a program merges MERGE_ROWS rows of a tile (more programs where a step has few tiles), loading
# the partial sums of MERGE_ELEMENTS // (rows x head size) splits at a time (a step of many splits waits on a few
# rounds of loads)
MERGE_ROWS = 16
MERGE_ELEMENTS = 8192
BLOCK_N = 128  # key positions per inner iteration (16-bit tiles of at most 32 query rows)
BLOCK_N_WIDE = 64  # float32, or tiles of 64 query rows (prefill chunks): smaller tiles keep to shared memory


def paged_attention_triton(q, k_cache, v_cache, block_tables, query_index, query_pos, scale: float,
                           sliding_window: int | None = None, num_splits: int | None = None,
                           block_n: int | None = None, num_warps: int | None = None, flat_index=None,
                           q_rows=None, split_short: bool = False, tree_bits=None, tree_base=None,
                           block_m: int | None = None):
    """q [T, Hq, D]; k_cache/v_cache [N, block_size, Hkv, D]; block_tables [B, M]; query_index,
    query_pos [B, Qw] -> out [T, Hq, D]. ``num_splits`` defaults to one up to ``ONE_SPLIT_KEYS`` table
    positions (``SHORT_SPLIT`` positions per split for a small decode or verify step with ``split_short`` and
    ``flat_index``: its consumer merges the splits) or past ``MAX_PARTIALS`` bytes of partial sums and otherwise
    to ``SPLIT`` positions per split, at least ``MIN_SPLITS`` splits (``launch_shape``); ``block_n`` (keys per
    inner iteration, default ``BLOCK_N``, at most a split's share where the table splits) and ``num_warps``
    (Triton's default) and ``block_m`` (a tile's query rows) are there for tuning (``benchmarks/bench_attention.py
    --sweep``, ``--prefill``). With ``flat_index`` [T]
    (b * Qw + j of each flat token) a step of several splits returns its partial sums unmerged
    (``AttnPartials``), for a consumer that merges them itself (the o projection's ATTN_MERGE prologue,
    ``gemv.merged_linear``) or calls ``merge()``. With ``q_rows`` [T'] (int64): output
    token i's query is q[q_rows[i]] and the output has T' rows (the layout's flat indices are output rows): a
    draft step 0 attends for each row's last token only without gathering its q rows first. With ``tree_bits``
    [B, Qw] int64 and ``tree_base`` [B]: a draft tree's mask (``build_mask``)."""
    t, hq, d = q.shape if q_rows is None else (q_rows.shape[0], *q.shape[1:])
    b, qw = query_index.shape
    page, hkv = k_cache.shape[1], k_cache.shape[2]
    g = hq // hkv
    if g > 64:
        raise ValueError(f"the Triton attention kernel packs at most 64 query heads per KV head, got {g}")
    tree = tree_bits is not None
    if query_pos.stride(0) != query_index.stride(0) or (tree and tree_bits.stride(0) != query_index.stride(0)):
        # the kernel indexes them all with one row stride
        query_pos = query_pos.contiguous().view(b, qw)
        query_index = query_index.contiguous().view(b, qw)
        tree_bits = tree_bits.contiguous().view(b, qw) if tree else None
    keys = block_tables.shape[1] * page
    head_d = triton.next_power_of_2(d)
    if num_warps is None and tree_verify_tiles(b, qw, g, tree, block_m):
        num_warps = TREE_WARPS
    # qpt queries per tile, n_qt tiles per row
    block_m, qpt, n_qt, auto_splits = launch_shape(b, qw, g, hkv, head_d, keys,
                                                   split_short and flat_index is not None, block_m, tree)
    num_splits = auto_splits if num_splits is None else num_splits
    share = triton.next_power_of_2(triton.cdiv(keys, num_splits))  # a split's keys, as a power of two
    # keys per inner iteration: where the table splits, at most a split's share, so that every split walks keys
    if not block_n:
        block_n = BLOCK_N if q.element_size() == 2 and block_m <= 32 else BLOCK_N_WIDE
        if num_splits > 1:
            block_n = max(16, min(block_n, share))
    # key positions per split: a power of two (few compiled variants) covering the table
    span = max(block_n, share)
    launch = dict(kernel_args(q), **({} if num_warps is None else {"num_warps": num_warps}))
    final = num_splits == 1  # the split kernel normalises and writes the output itself
    out = q.new_empty(t, hq, d)
    parts = (1, 1, 1) if final else (b * n_qt, hkv, num_splits)  # partial sums: unused with one split
    part_acc = torch.empty(parts + (block_m, head_d), dtype=torch.float32, device=q.device)
    part_ml = torch.empty(parts + (2, block_m), dtype=torch.float32, device=q.device)
    if t == 0 or b == 0:
        return out
    _attn_split_kernel[(b * n_qt, hkv, num_splits)](
        q, q_rows if q_rows is not None else query_index, k_cache, v_cache, block_tables, query_index, query_pos,
        tree_bits if tree else query_pos, tree_base if tree else query_pos, part_acc, part_ml, out, scale, t, qw, n_qt,
        keys, sliding_window or 0, q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), query_index.stride(0), out.stride(0), out.stride(1), num_splits,
        G=g, QPT=qpt, BLOCK_M=block_m, BLOCK_N=block_n, SPLIT=span, PAGE=page, D=d, HEAD_D=head_d,
        IEEE=q.dtype == torch.float32, DYNAMIC=not _INTERPRET, ITERS_STATIC=span // block_n, FINAL=final,
        HAS_QROWS=q_rows is not None, TREE=tree, **launch)
    parts = None if final else AttnPartials(out, part_acc, part_ml, query_index, query_pos, flat_index, qw, n_qt,
                                            qpt, g, block_m, head_d, num_splits, span)
    if parts is not None and flat_index is None:
        return parts.merge()
    return out if parts is None else parts


@dataclass
class AttnPartials:
    """A split step's partial softmax sums before the merge: ``acc`` [P, Hkv, S, BLOCK_M, HEAD_D] and ``ml``
    [P, Hkv, S, 2, BLOCK_M] (running max and sum) per tile P = b * n_qt + j // qpt, KV head and split; tile row
    m = (j % qpt) * g + grouped head. ``out`` [T, Hq, D] is the (unwritten) output buffer."""

    out: torch.Tensor
    acc: torch.Tensor
    ml: torch.Tensor
    query_index: torch.Tensor  # [B, Qw]
    query_pos: torch.Tensor  # [B, Qw]
    flat_index: torch.Tensor | None  # [T]
    qw: int
    n_qt: int
    qpt: int
    g: int
    block_m: int
    head_d: int
    num_splits: int
    span: int  # key positions per split

    def merge(self) -> torch.Tensor:
        """The merge kernel -> out [T, Hq, D]."""
        out, (b, qw) = self.out, self.query_index.shape
        rows = min(MERGE_ROWS, self.block_m)
        _attn_merge_kernel[(b * self.n_qt, self.acc.shape[1], self.block_m // rows)](
            self.acc, self.ml, out, self.query_index, self.query_pos, out.shape[0], qw, self.n_qt, out.stride(0),
            out.stride(1), self.query_index.stride(0), self.num_splits,
            G=self.g, QPT=self.qpt, BLOCK_M=self.block_m, SPLIT=self.span, D=out.shape[2], HEAD_D=self.head_d,
            ROWS=rows, SC=max(2, MERGE_ELEMENTS // (rows * self.head_d)), DYNAMIC=not _INTERPRET,
            NS_STATIC=self.num_splits if _INTERPRET else 0, **kernel_args(out))
        return out


def paged_attention_sdpa(q, k_cache, v_cache, block_tables, query_index, query_pos, scale: float,
                         sliding_window: int | None = None, flat_index=None, mask=None) -> torch.Tensor:
    """The reference: gather each row's blocks into a dense [B, K] layout and run PyTorch SDPA with a
    causal/length mask. q [T, Hq, D] -> [T, Hq, D]."""
    import torch.nn.functional as F

    t, hq, d = q.shape
    b, qlen = query_index.shape
    hkv = k_cache.shape[2]
    num_keys = block_tables.shape[1] * k_cache.shape[1]
    if mask is None:
        mask = build_mask(query_pos, num_keys, sliding_window)
    if flat_index is None:
        flat_index = _flat_index(query_index, t)
    q_pad = torch.cat((q, q.new_zeros(1, hq, d)))[query_index]  # [B, Q, Hq, D]
    k = k_cache[block_tables].view(b, -1, hkv, d)  # [B, K, Hkv, D]
    v = v_cache[block_tables].view(b, -1, hkv, d)
    out = F.scaled_dot_product_attention(q_pad.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         attn_mask=mask, scale=scale, enable_gqa=hq != hkv)  # [B, Hq, Q, D]
    return out.transpose(1, 2).reshape(b * qlen, hq, d)[flat_index]


def causal_prompt_sdpa(q, k_cache, v_cache, block_tables, query_index, scale: float, flat_index=None) -> torch.Tensor:
    """Rows whose queries are their first tokens (``AttentionMetadata.from_zero``: row b's query in column j sits
    at position j) -> causal attention over each row's first Q keys, gathered from its blocks, through PyTorch's
    SDPA with ``is_causal`` (no mask tensor, so its flash kernels apply; keys past a row's own tokens are seen
    only by its padding queries). q [T, Hq, D] -> [T, Hq, D]."""
    import torch.nn.functional as F

    t, hq, d = q.shape
    b, qlen = query_index.shape
    bs, hkv = k_cache.shape[1], k_cache.shape[2]
    nb = -(-qlen // bs)
    k = k_cache[block_tables[:, :nb]].view(b, nb * bs, hkv, d)[:, :qlen]  # [B, Q, Hkv, D]
    v = v_cache[block_tables[:, :nb]].view(b, nb * bs, hkv, d)[:, :qlen]
    one = b == 1 and t == qlen  # one row: its flat tokens are its columns, in order
    q_pad = q.view(1, t, hq, d) if one else torch.cat((q, q.new_zeros(1, hq, d)))[query_index]  # [B, Q, Hq, D]
    out = F.scaled_dot_product_attention(q_pad.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                         scale=scale, enable_gqa=hq != hkv)  # [B, Hq, Q, D]
    out = out.transpose(1, 2).reshape(b * qlen, hq, d)
    if one:
        return out
    return out[flat_index if flat_index is not None else _flat_index(query_index, t)]


_FLEX = {}


def paged_attention_flex(q, k_cache, v_cache, block_tables, query_index, query_pos, scale: float,
                         sliding_window: int | None = None, block_mask=None) -> torch.Tensor:
    """PyTorch FlexAttention over the same dense gather as the SDPA reference, with the causal/length (and
    window) rule as a ``mask_mod`` turned into a block mask (build it once per step with ``flex_block_mask``
    and pass it to every layer). Compiled on CUDA, eager elsewhere. q [T, Hq, D] -> [T, Hq, D]."""
    from torch.nn.attention.flex_attention import flex_attention

    t, hq, d = q.shape
    b, qlen = query_index.shape
    hkv = k_cache.shape[2]
    if block_mask is None:
        block_mask = flex_block_mask(query_pos, block_tables.shape[1] * k_cache.shape[1], sliding_window)
    fn = flex_attention
    if q.is_cuda:
        fn = _FLEX.get("compiled") or _FLEX.setdefault("compiled", torch.compile(flex_attention, dynamic=False))
    q_pad = torch.cat((q, q.new_zeros(1, hq, d)))[query_index]  # [B, Q, Hq, D]
    k = k_cache[block_tables].view(b, -1, hkv, d)  # [B, K, Hkv, D]
    v = v_cache[block_tables].view(b, -1, hkv, d)
    # Flex's decoding kernel holds a row's queries of all grouped heads in one tile; past 128 of them it finds
    # no kernel config that fits (seen on the H200 with a 70-token chunk, GQA 4, head_dim 128): use the main one
    opts = {"FORCE_USE_FLEX_ATTENTION": True} if qlen * (hq // hkv) > 128 else None
    out = fn(q_pad.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=block_mask, scale=scale,
             enable_gqa=hq != hkv, kernel_options=opts)  # [B, Hq, Q, D]
    return out.transpose(1, 2).reshape(b * qlen, hq, d)[_flat_index(query_index, t)]


def flex_block_mask(query_pos: torch.Tensor, num_keys: int, sliding_window: int | None):
    from torch.nn.attention.flex_attention import create_block_mask

    b, qlen = query_pos.shape

    def visible(bi, h, qi, kv):
        ok = kv <= query_pos[bi, qi]
        if sliding_window is not None:
            ok = ok & (kv > query_pos[bi, qi] - sliding_window)
        return ok

    return create_block_mask(visible, B=b, H=None, Q_LEN=qlen, KV_LEN=num_keys, device=query_pos.device)


def build_mask(query_pos: torch.Tensor, num_keys: int, sliding_window: int | None,
               tree_bits: torch.Tensor | None = None, tree_base: torch.Tensor | None = None) -> torch.Tensor:
    """query_pos [B, Q] -> mask [B, 1, Q, K] bool (key j visible to a query at p when j <= p). With a tree
    (``tree_bits`` [B, Q] int64, ``tree_base`` [B]): key j >= base with j - base < 64 is visible only where bit
    j - base of the query's mask is set (its ancestors and itself in a draft tree; -1 for an ordinary query)."""
    keys = torch.arange(num_keys, device=query_pos.device)
    qp = query_pos.unsqueeze(-1)
    mask = keys <= qp
    if sliding_window is not None:
        mask &= keys > qp - sliding_window
    if tree_bits is not None:
        rel = keys - tree_base[:, None, None]  # [B, 1, K]
        bit = (tree_bits.unsqueeze(-1) >> rel.clamp(0, 63)) & 1  # [B, Q, K]
        mask &= (rel < 0) | (rel >= 64) | (bit == 1)
    return mask.unsqueeze(1)


def _flat_index(query_index: torch.Tensor, t: int) -> torch.Tensor:
    """[T]: b * Q + q of each flat token (inverse of query_index)."""
    b, qlen = query_index.shape
    inv = torch.zeros(t + 1, dtype=torch.int64, device=query_index.device)
    inv.scatter_(0, query_index.reshape(-1), torch.arange(b * qlen, device=query_index.device))
    return inv[:t]


if HAVE_TRITON:
    @triton.jit
    def _tile_queries(pid, m, QIDX, QPOS, s_qi, T, QW, NQT, QPT: tl.constexpr, G: tl.constexpr):
        """Rows ``m`` of the tile of program ``pid`` (the whole tile, or the merge kernel's slice of it): m = (query j
        of row b) * G + grouped head gi. -> row b, gi, valid, flat token qi, position qp (-1 where not valid)."""
        b = (pid // NQT).to(tl.int64)
        j = (pid % NQT) * QPT + m // G
        valid = (m < QPT * G) & (j < QW)
        qi = tl.load(QIDX + b * s_qi + j, mask=valid, other=0)
        valid = valid & (qi < T)
        qp = tl.load(QPOS + b * s_qi + j, mask=valid, other=-1)
        return b, m % G, valid, qi, qp

    @triton.jit
    def _attn_tile(q, qp, start, hi, m_i, l_i, acc, KC, VC, BT, b, kvh, scale, WINDOW, sc_blk, sc_slot, sc_h,
                   s_bt, dd, dm, tb, tbase, BLOCK_N: tl.constexpr, PAGE: tl.constexpr, IEEE: tl.constexpr,
                   TREE: tl.constexpr):
        """Keys start .. start + BLOCK_N (below hi) folded into the running softmax (m_i, l_i, acc); with TREE,
        keys tbase .. tbase + 63 only where the query's ancestor bits ``tb`` [BLOCK_M] say so."""
        n = start + tl.arange(0, BLOCK_N)
        nm = n < hi
        blk = tl.load(BT + b * s_bt + n // PAGE, mask=nm, other=0).to(tl.int64)
        koff = blk * sc_blk + (n % PAGE) * sc_slot + kvh * sc_h
        k = tl.load(KC + koff[:, None] + dd[None, :], mask=nm[:, None] & dm[None, :], other=0.0)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = s * scale
        vis = (n[None, :] <= qp[:, None]) & nm[None, :]
        if WINDOW > 0:
            vis = vis & (n[None, :] > qp[:, None] - WINDOW)
        if TREE:
            rel = n - tbase  # [BLOCK_N]
            bit = (tb[:, None] >> tl.minimum(tl.maximum(rel, 0), 63)[None, :]) & 1
            vis = vis & ((rel[None, :] < 0) | (rel[None, :] >= 64) | (bit == 1))
        s = tl.where(vis, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(VC + koff[:, None] + dd[None, :], mask=nm[:, None] & dm[None, :], other=0.0)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        return m_new, l_i, acc

    @triton.jit
    def _attn_split_kernel(Q, QROWS, KC, VC, BT, QIDX, QPOS, TBITS, TBASE, PACC, PML, O, scale, T, QW, NQT, KEYS,
                           WINDOW,
                           sq_t, sq_h, sc_blk, sc_slot, sc_h, s_bt, s_qi, so_t, so_h, NS,
                           G: tl.constexpr, QPT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                           SPLIT: tl.constexpr, PAGE: tl.constexpr, D: tl.constexpr, HEAD_D: tl.constexpr,
                           IEEE: tl.constexpr, DYNAMIC: tl.constexpr, ITERS_STATIC: tl.constexpr,
                           FINAL: tl.constexpr, HAS_QROWS: tl.constexpr, TREE: tl.constexpr, PDL: tl.constexpr):
        pdl_begin(PDL)
        pdl_wait(PDL)  # everything here was written during the step
        pid = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        b, gi, valid, qi, qp = _tile_queries(pid, tl.arange(0, BLOCK_M), QIDX, QPOS, s_qi, T, QW, NQT, QPT, G)
        hq = kvh * G + gi
        dd = tl.arange(0, HEAD_D)
        dm = dd < D
        q_row = qi
        if HAS_QROWS:  # output token qi's query is another row of Q
            q_row = tl.load(QROWS + qi, mask=valid, other=0)
        q = tl.load(Q + q_row[:, None] * sq_t + hq[:, None] * sq_h + dd[None, :],
                    mask=valid[:, None] & dm[None, :], other=0.0)
        tb = qp  # a draft tree's ancestor bits of each tile row, and the row's first tree key (TREE only)
        tbase = b
        if TREE:
            j = (pid % NQT) * QPT + tl.arange(0, BLOCK_M) // G
            tb = tl.load(TBITS + b * s_qi + j, mask=valid, other=-1)
            tbase = tl.load(TBASE + b)
        # keys needed by this tile: 0 .. max position, within the block table (a query past its row's table, a row
        # that drafts nothing at a position it holds no block for, sees the keys the table holds, none past it)
        hi = tl.minimum(tl.max(qp, axis=0) + 1, KEYS)
        lo_split = split.to(tl.int64) * SPLIT
        hi_split = tl.minimum(hi, lo_split + SPLIT)
        lo = lo_split
        if DYNAMIC:
            if WINDOW > 0:  # skip keys no query of the tile can see
                lo = tl.maximum(lo, tl.min(tl.where(valid, qp, 1 << 30), axis=0) - WINDOW + 1)
        m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_D], dtype=tl.float32)
        if DYNAMIC:
            for it in range(0, tl.cdiv(hi_split - lo, BLOCK_N)):
                m_i, l_i, acc = _attn_tile(q, qp, lo + it * BLOCK_N, hi_split, m_i, l_i, acc, KC, VC, BT, b, kvh,
                                           scale, WINDOW, sc_blk, sc_slot, sc_h, s_bt, dd, dm, tb, tbase,
                                           BLOCK_N, PAGE, IEEE, TREE)
        else:  # Triton's interpreter (CPU tests) needs loop bounds known to the host: masked full splits
            for it in range(0, ITERS_STATIC):
                m_i, l_i, acc = _attn_tile(q, qp, lo + it * BLOCK_N, hi_split, m_i, l_i, acc, KC, VC, BT, b, kvh,
                                           scale, WINDOW, sc_blk, sc_slot, sc_h, s_bt, dd, dm, tb, tbase,
                                           BLOCK_N, PAGE, IEEE, TREE)
        if FINAL:  # the only split: normalise and write the output (what the merge kernel would do)
            out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
            tl.store(O + qi[:, None] * so_t + hq[:, None] * so_h + dd[None, :], out.to(O.dtype.element_ty),
                     mask=valid[:, None] & dm[None, :])
        else:
            base = (pid.to(tl.int64) * tl.num_programs(1) + kvh) * NS + split
            rows = tl.arange(0, BLOCK_M)
            tl.store(PACC + base * (BLOCK_M * HEAD_D) + rows[:, None] * HEAD_D + dd[None, :], acc)
            tl.store(PML + base * (2 * BLOCK_M) + rows, m_i)
            tl.store(PML + base * (2 * BLOCK_M) + BLOCK_M + rows, l_i)

    @triton.jit
    def _merge_splits(PACC, PML, first, left, m, dd, m_tot, l_tot, acc, BLOCK_M: tl.constexpr, HEAD_D: tl.constexpr,
                      SC: tl.constexpr):
        """Splits ``first`` .. ``first`` + SC - 1 (those below ``first`` + ``left``) of tile rows ``m`` [ROWS] folded
        into the running (m_tot, l_tot, acc) one after another, as the o projection's prologue folds them (the same
        sums to the bit); unrolled, so the loads of all SC splits are issued before the folds wait on them."""
        for k in tl.static_range(SC):
            ok = k < left
            base = first + k
            m_s = tl.load(PML + base * (2 * BLOCK_M) + m, mask=ok, other=-1.0e30)
            l_s = tl.load(PML + base * (2 * BLOCK_M) + BLOCK_M + m, mask=ok, other=0.0)
            a_s = tl.load(PACC + base * (BLOCK_M * HEAD_D) + m[:, None] * HEAD_D + dd[None, :], mask=ok, other=0.0)
            m_new = tl.maximum(m_tot, m_s)
            c_old = tl.exp(m_tot - m_new)
            c_s = tl.exp(m_s - m_new)
            l_tot = l_tot * c_old + l_s * c_s
            acc = acc * c_old[:, None] + a_s * c_s[:, None]
            m_tot = m_new
        return m_tot, l_tot, acc

    @triton.jit
    def _attn_merge_kernel(PACC, PML, O, QIDX, QPOS, T, QW, NQT, so_t, so_h, s_qi, NS,
                           G: tl.constexpr, QPT: tl.constexpr, BLOCK_M: tl.constexpr, SPLIT: tl.constexpr,
                           D: tl.constexpr, HEAD_D: tl.constexpr, ROWS: tl.constexpr, SC: tl.constexpr,
                           DYNAMIC: tl.constexpr, NS_STATIC: tl.constexpr, PDL: tl.constexpr):
        """Program (tile, KV head, ROWS-row slice of the tile): the slice's splits merged SC at a time (their loads
        issued together), so that a step of few tiles and many splits (a prompt over a long cached prefix) spreads
        over more programs and waits on a few rounds of loads, not on one load per split."""
        pdl_begin(PDL)
        pdl_wait(PDL)
        pid = tl.program_id(0)
        kvh = tl.program_id(1)
        m = tl.program_id(2) * ROWS + tl.arange(0, ROWS)  # the slice's tile rows
        b, gi, valid, qi, qp = _tile_queries(pid, m, QIDX, QPOS, s_qi, T, QW, NQT, QPT, G)
        # splits that saw keys of these rows (every split wrote its partial sums; past a row's position l = 0)
        n_used = tl.minimum((tl.max(qp, axis=0) + SPLIT) // SPLIT, NS)
        dd = tl.arange(0, HEAD_D)
        m_tot = tl.full([ROWS], -1.0e30, dtype=tl.float32)
        l_tot = tl.zeros([ROWS], dtype=tl.float32)
        acc = tl.zeros([ROWS, HEAD_D], dtype=tl.float32)
        base0 = (pid.to(tl.int64) * tl.num_programs(1) + kvh) * NS
        if DYNAMIC:
            for c in range(0, tl.cdiv(n_used, SC)):
                m_tot, l_tot, acc = _merge_splits(PACC, PML, base0 + c * SC, n_used - c * SC, m, dd,
                                                  m_tot, l_tot, acc, BLOCK_M, HEAD_D, SC)
        else:  # the interpreter: a host-known bound
            for c in range(0, (NS_STATIC + SC - 1) // SC):
                m_tot, l_tot, acc = _merge_splits(PACC, PML, base0 + c * SC, NS - c * SC, m, dd,
                                                  m_tot, l_tot, acc, BLOCK_M, HEAD_D, SC)
        out = acc / tl.where(l_tot > 0, l_tot, 1.0)[:, None]
        hq = kvh * G + gi
        tl.store(O + qi[:, None] * so_t + hq[:, None] * so_h + dd[None, :], out.to(O.dtype.element_ty),
                 mask=valid[:, None] & (dd < D)[None, :])
