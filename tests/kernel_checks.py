"""Each Triton kernel against its PyTorch reference on random inputs, the few-row linears' checks in
``linear_checks.py``, the tree step's in ``tree_checks.py`` (run by tests/test_kernels.py on the GPU, or on the
CPU through Triton's interpreter: ``TRITON_INTERPRET=1 python tests/kernel_checks.py``)."""

from __future__ import annotations

import os
import sys

import torch

from check_util import QUICK, _close, faster_interpreter_device_calls, kernel_check
from tree_checks import TREE_CHECKS
from linear_checks import (check_attn_merge_fold, check_gemv, check_gemv_rows, check_norm_fold, check_qkv_rope,
                           check_qkv_rows)
from specserve.kernels.accept import greedy_accept, greedy_accept_ref
from specserve.kernels.argmax import CHUNK, argmax_lastdim
from specserve.kernels.activation import silu_and_mul, silu_and_mul_ref
from specserve.kernels.attention import (AttnPartials, _flat_index, build_mask, paged_attention_flex,
                                         paged_attention_sdpa, paged_attention_triton)
from specserve.kernels.attention_launch import SHORT_SPLIT
from specserve.kernels.norm import embed_norm_cat, rms_norm, rms_norm_ref
from specserve.kernels.rope import rope_and_cache, rope_ref, write_kv_ref
from specserve.kernels.draft_inputs import draft_inputs, draft_inputs_ref
from specserve.kernels.step_inputs import correct_record, correct_record_ref, expand_record, expand_record_ref
from specserve.runner.sampler import SamplingTensors
from specserve.speculative.tree import tree_layout
from specserve.speculative import accept as spec_accept


@kernel_check
def check_norm(device, dtype):
    g = torch.Generator().manual_seed(0)
    for h in (64, 576, 1000):
        x = torch.randn(7, h, generator=g).to(device, dtype)
        r = torch.randn(7, h, generator=g).to(device, dtype)
        w = (1 + 0.1 * torch.randn(h, generator=g)).to(device, dtype)
        _close(rms_norm(x, w, 1e-5), rms_norm_ref(x, w, 1e-5), dtype, "rms_norm")
        out, res = rms_norm(x, w, 1e-5, r)
        ref_out, ref_res = rms_norm_ref(x, w, 1e-5, r)
        assert torch.equal(res, ref_res), "residual add"
        _close(out, ref_out, dtype, "rms_norm+residual")


@kernel_check
def check_silu(device, dtype):
    g = torch.Generator().manual_seed(1)
    for i in (64, 1536, 1500):
        x = torch.randn(5, 2 * i, generator=g).to(device, dtype)
        _close(silu_and_mul(x), silu_and_mul_ref(x), dtype, "silu_and_mul")


@kernel_check
def check_rope_cache(device, dtype):
    g = torch.Generator().manual_seed(2)
    t, hq, hkv, d, n, bs = 6, 9, 3, 64, 5, 16
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g).to(device, dtype)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    q, k, v = q.view(t, hq, d), k.view(t, hkv, d), v.view(t, hkv, d)
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    freqs = torch.outer(torch.arange(100).float(), inv)
    cos, sin = freqs.cos().to(device), freqs.sin().to(device)
    pos = torch.tensor([0, 5, 17, 40, 41, 99], device=device)
    slots = torch.tensor([16, 21, 33, 79, 64, 0], device=device)
    kc, vc = (torch.zeros(2, n, bs, hkv, d, dtype=dtype, device=device) for _ in range(2))
    qo = rope_and_cache(pos, q, k, v, cos, sin, kc[0], vc[0], slots)
    rq, rk = rope_ref(pos, q, k, cos, sin)
    write_kv_ref(kc[1], vc[1], rk, v, slots)
    _close(qo, rq, dtype, "rope q")
    _close(kc[0], kc[1], dtype, "rope k -> cache")
    assert torch.equal(vc[0], vc[1]), "v -> cache"




@kernel_check
def check_attention(device, dtype):
    g = torch.Generator().manual_seed(3)
    for hq, hkv, d in ((9, 3, 64), (4, 4, 32)) if QUICK else ((9, 3, 64), (32, 8, 128), (4, 4, 32)):
        n_blocks, bs = 64, 16
        kc = torch.randn(n_blocks, bs, hkv, d, generator=g).to(device, dtype)
        vc = torch.randn(n_blocks, bs, hkv, d, generator=g).to(device, dtype)
        # rows: a verify row (5 queries), a decode row, a long prefill chunk, a padded row, a row past one split
        lens = [(37, 5), (16, 1), (200, 24), (3, 2), (300, 5)] if QUICK else \
            [(37, 5), (16, 1), (300, 70), (3, 2), (610, 5)]
        m = 20 if QUICK else 40
        tables = torch.zeros(len(lens), m, dtype=torch.int64)
        qw = max(nq for _, nq in lens)
        qidx = torch.full((len(lens), qw), 0, dtype=torch.int64)
        qpos = torch.zeros(len(lens), qw, dtype=torch.int64)
        t = sum(nq for _, nq in lens)
        qidx.fill_(t)
        t0 = 0
        perm = torch.randperm(n_blocks - 1, generator=g) + 1
        used = 0
        for b, (ctx, nq) in enumerate(lens):
            nb = -(-ctx // bs)
            tables[b, :nb] = perm[used % (n_blocks - 1):used % (n_blocks - 1) + nb] if used % (n_blocks - 1) + nb < n_blocks else perm[:nb]
            used += nb
            qidx[b, :nq] = torch.arange(t0, t0 + nq)
            qpos[b, :nq] = torch.arange(ctx - nq, ctx)
            t0 += nq
        q = torch.randn(t, hq, d, generator=g).to(device, dtype)
        args = (q, kc, vc, tables.to(device), qidx.to(device), qpos.to(device), d ** -0.5)
        ref = paged_attention_sdpa(*args)
        # 640 (quick: 320) table positions: several splits with partial sums and the merge kernel; forced to one
        # split, the split kernel writes the output itself (the default up to ONE_SPLIT_KEYS positions)
        _close(paged_attention_triton(*args), ref, dtype, f"paged attention {hq}/{hkv}/{d}")
        _close(paged_attention_triton(*args, num_splits=1), ref, dtype, f"paged attention, 1 split {hq}/{hkv}/{d}")
        # more splits than the merge kernel folds in one load (MERGE_ELEMENTS), the last load part-masked
        _close(paged_attention_triton(*args, num_splits=11), ref, dtype, f"paged attention, 11 splits {hq}/{hkv}/{d}")
        # the queries read in place from other rows of a larger q (q_rows): the same outputs, to the bit
        sel = torch.randperm(t + 7, generator=g)[:t].to(device)
        wide = torch.zeros(t + 7, hq, d, dtype=dtype, device=device)
        wide[sel] = q
        for ns in (None, 1):
            assert torch.equal(paged_attention_triton(wide, *args[1:], num_splits=ns, q_rows=sel),
                               paged_attention_triton(*args, num_splits=ns)), f"attention q_rows {hq}/{hkv}/{d} {ns}"
        # FlexAttention, the third implementation (compiled on CUDA: bfloat16 only, to bound compile time)
        if dtype == (torch.bfloat16 if device == "cuda" else torch.float32):
            _close(paged_attention_flex(*args), ref, dtype, f"flex attention {hq}/{hkv}/{d}")
        # a query past its row's block table (a row that drafts nothing, at positions it holds no blocks for): it
        # sees every key the table holds, and nothing is read past the table
        far = qpos.clone()
        far[1, 0] = tables.shape[1] * bs + 37
        far_args = (q, kc, vc, tables.to(device), qidx.to(device), far.to(device), d ** -0.5)
        for ns in (None, 1):
            _close(paged_attention_triton(*far_args, num_splits=ns), paged_attention_sdpa(*far_args), dtype,
                   f"a query past its table, {ns} splits")
        # draft trees: rows 0 and 4 verify a root and 4 nodes of random parents (each query sees the keys before
        # the root and its ancestors'), the others stay causal (bits -1); several splits and one
        bits = torch.full_like(qpos, -1)
        base = torch.zeros(len(lens), dtype=torch.int64)
        for b in (0, 4):
            ctx, nq = lens[b]
            parents = [int(torch.randint(0, c, (1,), generator=g)) for c in range(1, nq)]
            base[b] = ctx - nq
            bits[b, :nq] = torch.tensor(tree_layout(parents)[1])
        tree = dict(tree_bits=bits.to(device), tree_base=base.to(device))
        mask = build_mask(qpos.to(device), tables.shape[1] * bs, None, **tree)
        tref = paged_attention_sdpa(*args, mask=mask)
        assert not torch.equal(tref, ref), "the tree mask changes nothing"
        for ns in (None, 1):
            _close(paged_attention_triton(*args, num_splits=ns, **tree), tref, dtype, f"tree attention, {ns} splits")
        for window, ns in ((8, 1), (100, None)) if QUICK else ((8, None), (8, 1), (100, None), (100, 1)):
            _close(paged_attention_triton(*args, sliding_window=window, num_splits=ns),
                   paged_attention_sdpa(*args, sliding_window=window), dtype, f"sliding window {window}, {ns}")
        # short tables (256 positions, and 176) of a verify row ending at position 170 and a decode row at 130,
        # whose consumer merges: SHORT_SPLIT-key splits, each walked in iterations of its own width; the same
        # outputs at both widths, to the bit
        sq = torch.randn(6, hq, d, generator=g).to(device, dtype)
        s_idx = torch.tensor([[0, 1, 2, 3, 4], [5, 6, 6, 6, 6]], device=device)
        s_pos = torch.tensor([[166, 167, 168, 169, 170], [130, 0, 0, 0, 0]], device=device)
        s_tab = (torch.randperm(n_blocks - 1, generator=g)[:2 * 16] + 1).view(2, 16).to(device)
        got = {}
        for keys in (256, 176):
            short = (sq, kc, vc, s_tab[:, :keys // bs], s_idx, s_pos, d ** -0.5)
            parts = paged_attention_triton(*short, flat_index=_flat_index(s_idx, 6), split_short=True)
            assert isinstance(parts, AttnPartials) and parts.num_splits == -(-keys // SHORT_SPLIT), \
                f"a short table of {keys} positions did not split in {SHORT_SPLIT}-key splits"
            got[keys] = parts.merge()
            _close(got[keys], paged_attention_sdpa(*short), dtype, f"short table {keys} in splits {hq}/{hkv}/{d}")
        assert torch.equal(got[256], got[176]), f"short tables of 256 and 176 positions differ {hq}/{hkv}/{d}"


@kernel_check
def check_greedy_accept(device, dtype):
    """Exact: every prefix length, rows verifying fewer drafts, rows that cannot accept, D = 1..6."""
    del dtype  # integer work; run once per dtype like the other checks
    g = torch.Generator().manual_seed(4)
    for d in range(1, 7):
        b = 64
        argmax = torch.randint(0, 5, (b, d + 1), generator=g)
        drafts = torch.where(torch.rand(b, d, generator=g) < 0.7, argmax[:, :d], torch.randint(0, 5, (b, d), generator=g))
        num = torch.randint(0, d + 1, (b,), generator=g)
        can = torch.rand(b, generator=g) < 0.8
        args = [x.to(device) for x in (argmax, drafts, num, can)]
        acc, em = greedy_accept(*args)
        cols = torch.arange(d, device=device)
        ref_acc, ref_em = greedy_accept_ref(args[0], args[1], (cols[None, :] < args[2][:, None]) & args[3][:, None])
        assert torch.equal(acc, ref_acc) and torch.equal(em, ref_em), f"greedy accept, D={d}"
        buf = torch.full((d + 3, b), -1, dtype=torch.int64, device=device)  # a step's result rows, one row more
        greedy_accept(*args, out=buf[:d + 2])
        assert torch.equal(buf[0], ref_acc) and torch.equal(buf[1:d + 2].t(), ref_em) and (buf[d + 2] == -1).all(), \
            f"greedy accept into the result rows, D={d}"
        assert int(ref_acc.max()) == d or d > 4, "the check should reach full acceptance"
        # forced acceptance (spec.accept): the same draws as its PyTorch ops, seeds spanning 64 bits
        seeds = torch.randint(-2 ** 62, 2 ** 62, (b,), generator=g)
        offsets = torch.randint(0, 100000, (b,), generator=g)
        for forced in (0.0, 1.5, d - 0.25, float(d)):
            off = torch.zeros(b, dtype=torch.bool)
            sampling = SamplingTensors(*(torch.zeros(b) for _ in range(4)), seeds, offsets, True, False)
            a = spec_accept.AcceptInputs(sampling, greedy=~off, can_accept=can, relaxed=off,
                                         relaxed_topk=torch.ones(b, dtype=torch.int64), relaxed_delta=torch.zeros(b),
                                         thinking=off, simple_greedy=True)
            ref_acc = spec_accept._forced(forced, num, a)
            ref = (ref_acc, spec_accept.emit(drafts, argmax[torch.arange(b), ref_acc], ref_acc))
            draw = spec_accept.ForcedDraw(int(forced), forced - int(forced), seeds.to(device), offsets.to(device),
                                          spec_accept._FORCED_SALT ^ spec_accept._ACCEPT_SALT)
            got = greedy_accept(*args, forced=draw)
            assert all(torch.equal(x.cpu(), y) for x, y in zip(got, ref)), f"forced acceptance {forced}, D={d}"


@kernel_check
def check_argmax(device, dtype):
    """Exact, ties included: the lowest index of the maximum, within a chunk and across chunks."""
    g = torch.Generator().manual_seed(5)
    for rows, v in ((1, 49152), (5, 128256), (7, CHUNK), (3, 1000), (64, 32000)):
        x = torch.randn(rows, v, generator=g).to(dtype)
        x[0, v // 3] = x[0, v - 1] = 50.0  # a tie across chunks: the first one wins
        if rows > 2:
            x[1, 7] = x[1, 8] = 50.0  # a tie inside a chunk
            x[2] = float("-inf")  # nothing finite: index 0, like torch
        x = x.to(device)
        got = argmax_lastdim(x)
        ref = x.float().cpu().argmax(dim=-1).to(device)
        assert torch.equal(got, ref), f"argmax {rows}x{v} {dtype}"
        assert int(got[0]) == v // 3
    x = torch.randn(2, 5, 3000, generator=g).to(device=device, dtype=dtype)  # leading dims
    assert torch.equal(argmax_lastdim(x), x.argmax(dim=-1))
    ids = torch.randperm(50000, generator=g)[:3000].to(device)  # a draft vocabulary's target ids
    assert torch.equal(argmax_lastdim(x, ids), ids[x.argmax(dim=-1)])


@kernel_check
def check_embed_norm_cat(device, dtype):
    """EAGLE-3 / MTP input: cat(norm(embedding of ids), norm(hidden)) in one kernel == the three ops."""
    g = torch.Generator().manual_seed(6)
    for n, h in ((1, 576), (7, 64), (3, 1000)):
        table = torch.randn(300, h, generator=g).to(device, dtype)
        ids = torch.randint(0, 300, (n,), generator=g).to(device)
        hidden = torch.randn(n, h, generator=g).to(device, dtype)
        w1, w2 = ((1 + 0.1 * torch.randn(h, generator=g)).to(device, dtype) for _ in range(2))
        got = embed_norm_cat(ids, table, w1, hidden, w2, 1e-5)
        ref = torch.cat((rms_norm_ref(table[ids], w1, 1e-5), rms_norm_ref(hidden, w2, 1e-5)), dim=-1)
        assert got.shape == (n, 2 * h) and got.dtype == ref.dtype
        _close(got, ref, dtype, "embed_norm_cat")


@kernel_check
def check_step_inputs(device, dtype):
    """A graph step's record expanded in one kernel == the PyTorch ops (exact: integers and flags)."""
    g = torch.Generator().manual_seed(7)
    for b, q, m, d in ((1, 1, 16, None), (3, 5, 32, 4), (8, 5, 64, 4), (1, 64, 16, 4), (4, 3, 16, 2)):
        real = max(1, b - 1)  # the last row is a dummy when b > 1
        count = torch.randint(1, q + 1, (b,), generator=g)
        count[real:] = 1
        nd = torch.minimum(torch.randint(0, (d or 0) + 1, (b,), generator=g), count - 1)
        nd[real:] = 0
        start = torch.randint(0, 16 * m - 2 * q, (b,), generator=g)
        start[real:] = 0
        tokens = torch.randint(0, 1000, (b, q), generator=g) * (torch.arange(q) < count[:, None])
        tables = torch.randint(1, 500, (b, m), generator=g)
        flags = torch.randint(0, 2, (4, b), generator=g) if d else None
        args = [x.to(device) for x in (start, count, nd, tokens, tables)]
        kw = dict(draft_len=d, flags=flags.to(device)) if d else {}
        got = expand_record(*args, 16, **kw)
        ref = expand_record_ref(*args, 16, **kw)
        assert got.keys() == ref.keys()
        for k in ref:
            assert got[k].dtype == ref[k].dtype and torch.equal(got[k], ref[k]), f"step inputs {k} {b}x{q} D={d}"


@kernel_check
def check_correct_record(device, dtype):
    """The overlap scheduler's correction of rows that continue the step in flight, in one kernel == the PyTorch
    ops (exact): plain and speculative, rows with and without a source row, the thinking phase tracked or not."""
    g = torch.Generator().manual_seed(9)
    for b, d, think, n in ((1, 0, (-1, -1), 0), (5, 0, (-1, -1), 0), (6, 3, (-1, -1), 0), (8, 4, (7, 9), 0),
                           (3, 1, (-1, 9), 0), (7, 3, (-1, -1), 6), (4, 2, (7, 9), 9)):
        tree = n > 0
        n = n or d
        q, cols = 1 + n, 10
        width = 2 + d + 2 * n if tree else (2 * d + 2 if d else 1)
        carry = torch.randint(0, 12, (cols + 1, width), generator=g)
        if d:
            carry[:, 0] = torch.randint(0, d + 1, (cols + 1,), generator=g)  # accepted counts
        if tree:  # each node's parent an earlier column, at most d deep
            for c in range(1, n + 1):
                carry[:, d + 1 + n + c] = torch.randint(0, c, (cols + 1,), generator=g)
            depth = torch.zeros(cols + 1, n + 1, dtype=torch.int64)
            for c in range(1, n + 1):
                depth[:, c] = depth.gather(1, carry[:, d + 1 + n + c:d + 2 + n + c]).squeeze(1) + 1
            carry[:, d + 2 + n:] = torch.where(depth[:, 1:] <= d, carry[:, d + 2 + n:], 0)
        f = dict(src=torch.where(torch.rand(b, generator=g) < 0.7, torch.randint(0, cols, (b,), generator=g), -1),
                 start=torch.randint(20, 60, (b,), generator=g), count=torch.full((b,), q),
                 num_drafts=torch.full((b,), d), offsets=torch.randint(5, 30, (b,), generator=g))
        if d:
            f.update(prev_nd=torch.randint(0, n + 1, (b,), generator=g), room=torch.randint(-3, d + 3, (b,), generator=g),
                     cap=torch.randint(0, n + 1, (b,), generator=g), flags=torch.randint(0, 2, (4 * b,), generator=g))
        if tree:
            f["parents"] = torch.randint(0, 3, (b * n,), generator=g)
        tokens = torch.randint(0, 1000, (b, q), generator=g)
        got_f = {k: v.clone().to(device) for k, v in f.items()}
        got_t = tokens.clone().to(device)
        nodes = n if tree else None
        correct_record(got_f, got_t, carry.to(device), d, think, nodes)
        correct_record_ref(f, tokens, carry, d, think, nodes)
        assert torch.equal(got_t.cpu(), tokens), f"corrected tokens b={b} D={d}"
        for k in f:
            assert torch.equal(got_f[k].cpu(), f[k]), f"corrected {k} b={b} D={d}"


@kernel_check
def check_draft_inputs(device, dtype):
    """The draft loop's inputs after acceptance in one kernel == the PyTorch ops (exact), for a graph layout
    (every row q tokens) and a packed one (rows of different lengths), with rows that do not draft."""
    g = torch.Generator().manual_seed(8)
    for b, q, d, packed in ((1, 5, 4, False), (6, 5, 4, False), (5, 7, 3, True), (3, 2, 1, False), (40, 5, 4, False)):
        w, m, bs = q + d + 2, 8, 16
        counts = torch.randint(1, q + 1, (b,), generator=g) if packed else torch.full((b,), q)
        nd = torch.minimum(torch.randint(0, d + 1, (b,), generator=g), counts - 1)
        base_col = counts - 1 - nd
        accepted = (torch.rand(b, generator=g) * (nd + 1)).long()
        row = torch.repeat_interleave(torch.arange(b), counts)
        col = torch.cat([torch.arange(int(c)) for c in counts])
        ext = torch.randint(0, 1000, (b, w), generator=g)
        args = [accepted, torch.randint(0, 1000, (b, d + 1), generator=g), base_col,
                torch.cumsum(counts, 0) - counts, torch.randint(0, 100, (b,), generator=g), ext,
                torch.rand(b, generator=g) < 0.7, torch.randint(1, 60, (b, m), generator=g), row, col]
        args = [x.to(device) for x in args]
        for max_pos in (10_000, 60):  # the second clamps chain positions
            got = draft_inputs(*args, bs, d, max_pos)
            ref = draft_inputs_ref(*args, bs, d, max_pos)
            assert got.keys() == ref.keys()
            for k in ref:
                assert torch.equal(got[k], ref[k]), f"draft inputs {k} b={b} q={q} d={d} packed={packed}"


CHECKS = [check_norm, check_silu, check_rope_cache, check_attention, check_greedy_accept, *TREE_CHECKS, check_argmax,
          check_embed_norm_cat, check_step_inputs, check_correct_record, check_draft_inputs, check_gemv, check_gemv_rows,
          check_qkv_rope, check_qkv_rows, check_norm_fold, check_attn_merge_fold]

def dtypes(device: str):
    """bfloat16 on the GPU; Triton's interpreter cannot run tl.dot on bfloat16, so float16 stands in there."""
    return (torch.float32, torch.bfloat16, torch.float16) if device == "cuda" else (torch.float32, torch.float16)


if __name__ == "__main__":
    dev = sys.argv[1] if len(sys.argv) > 1 else "cpu"
    faster_interpreter_device_calls()
    if os.environ.get("SPECSERVE_BUILD_SM"):  # interpreting: also build each kernel for that GPU (kernel_build.py)
        import kernel_build
        launched = kernel_build.record(("bf16",) if QUICK else ("fp16", "bf16"))
    for dt in dtypes(dev):
        for c in CHECKS:
            c(dev, dt)
            print(f"{c.__name__} {dt}: ok", flush=True)
    if os.environ.get("SPECSERVE_BUILD_SM"):
        kernel_build.build_recorded(launched, int(os.environ["SPECSERVE_BUILD_SM"]))
