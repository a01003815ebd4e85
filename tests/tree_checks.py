"""The tree step's kernels against their PyTorch references (acceptance, the path's KV move, draft step 0's
inputs, the attention layout, one depth of the expansion, the next tree's selection); run with the other kernel
checks (``kernel_checks.py``)."""

from __future__ import annotations

import torch

from check_util import QUICK, kernel_check
from specserve.kernels.tree_accept import tree_compact_kv, tree_greedy_accept
from specserve.kernels.tree_draft import tree_draft_inputs, tree_draft_inputs_ref
from specserve.kernels.tree_expand import Frontier, expand_depth, expand_depth_ref, select_tree, select_tree_ref
from specserve.kernels.tree_layout import tree_attention_layout, tree_attention_layout_ref
from specserve.speculative.tree_accept import accept_greedy_ref, compact_path_kv_ref


@kernel_check
def check_tree_accept(device, dtype):
    """Exact: random trees of N = 1..63 nodes and depth D <= 8 (parents before children), tokens that match the
    argmax at their parent 70% of the time, rows verifying fewer nodes, rows that cannot accept."""
    del dtype  # integer work
    g = torch.Generator().manual_seed(8)
    for n, d in ((1, 1), (6, 3), (24, 6), (63, 6), (48, 8)) if not QUICK else ((6, 3), (24, 6)):
        b = 48
        parents = torch.zeros(b, n, dtype=torch.int64)
        depth = torch.zeros(b, n + 1, dtype=torch.int64)
        for c in range(1, n + 1):  # a parent among the earlier columns shallower than D
            ok = depth[:, :c] < d
            pick = torch.multinomial(ok.float(), 1, generator=g)[:, 0]
            parents[:, c - 1] = pick
            depth[:, c] = depth.gather(1, pick[:, None])[:, 0] + 1
        argmax = torch.randint(0, 4, (b, n + 1), generator=g)
        nodes = torch.where(torch.rand(b, n, generator=g) < 0.7, argmax.gather(1, parents),
                            torch.randint(0, 4, (b, n), generator=g))
        num = torch.randint(0, n + 1, (b,), generator=g)
        can = torch.rand(b, generator=g) < 0.9
        args = [x.to(device) for x in (argmax, nodes, parents, num, can)]
        got = tree_greedy_accept(*args, d)
        assert got is not None, "the tree acceptance kernel did not run"
        valid = (torch.arange(n, device=device)[None, :] < args[3][:, None]) & args[4][:, None]
        ref = accept_greedy_ref(args[0], args[1], args[2], valid, d)
        for name, x, y in zip(("accepted", "path", "emitted"), got, (ref.accepted, ref.path, ref.emitted)):
            assert torch.equal(x, y), f"tree accept {name}, N={n} D={d}"
        assert int(ref.accepted.max()) >= min(d, 2), "the check should reach deep paths"
    # rows whose node count exceeds the layout's columns, a padding row holding a stale parent just past the first
    # row's columns, and a row with a parent after its node: the kernel reads only a row's own columns and parents
    # that precede their node (the old kernel read past a row into the next one's parents and used what it found
    # as an index into the argmax, which crashes Triton's interpreter; one way a tree engine at 16-32 rows could
    # have reached an illegal address on the H100)
    n = d = 6
    parents = torch.arange(n).repeat(4, 1)  # chains
    argmax = torch.randint(0, 50, (4, n + 1), generator=g)
    nodes = argmax[:, :n].clone()  # every node matches
    parents[1, 0] = 1 << 40
    parents[3, 2] = 5  # node 3's parent: node 5, after it
    nodes[3, 2] = argmax[3, 5]  # ... whose token it matches: read as a parent, node 3 would count as accepted
    num, can = torch.tensor([24, 24, 24, 6]), torch.tensor([True, False, True, True])
    got = tree_greedy_accept(*[x.to(device) for x in (argmax, nodes, parents, num, can)], d)
    assert got is not None and got[0].tolist() == [6, 0, 6, 2], got[0]
    keep = torch.tensor([0, 2])
    valid = torch.ones(2, n, dtype=torch.bool)
    ref = accept_greedy_ref(argmax[keep], nodes[keep], parents[keep], valid, d)
    for x, y in zip(got, (ref.accepted, ref.path, ref.emitted)):
        assert torch.equal(x[keep.to(device)].cpu(), y), "tree accept: rows that count more nodes than they have"
    assert got[2][1].tolist() == [int(argmax[1, 0])] + [0] * n and got[2][3].tolist()[:3] == argmax[3, :3].tolist()


@kernel_check
def check_tree_compact(device, dtype):
    """Exact: each row's accepted path moved to the positions after its root in every layer's keys and values
    (paths whose nodes sit where an earlier depth's node lands, rows accepting nothing, block tables out of order;
    rows own their blocks, as in the engine), and nothing else written."""
    g = torch.Generator().manual_seed(9)
    layers, blocks, bs, b, d = 3, 24, 4, 6, 4
    kv = torch.randn(layers, 2, blocks, bs, 2, 8, generator=g).to(device, dtype)
    tables = torch.randperm(blocks, generator=g).view(b, 4)  # [B, 4]: 16 positions a row, blocks of its own
    root = torch.randint(0, 8, (b,), generator=g)
    steps = torch.randint(1, 3, (b, d), generator=g)  # column gaps: the node at depth i at column >= i
    path = steps.cumsum(dim=1)
    path[0] = torch.tensor([2, 3, 4, 5])  # each node lands where the previous depth's node was
    acc = torch.tensor([4, 0, 2, 1, 3, 4])
    args = [x.to(device) for x in (tables, root, path, acc)]
    ref = kv.clone()
    compact_path_kv_ref(ref, *args, bs)
    got = kv.clone()
    assert tree_compact_kv(got, *args, bs), "the KV compaction kernel did not run"
    assert torch.equal(got, ref), "tree KV compaction"
    assert not torch.equal(ref, kv), "the check should move something"


@kernel_check
def check_tree_draft_inputs(device, dtype):
    """Exact: draft step 0's per-token inputs after a tree step's acceptance, rows verifying trees (root at column
    0), rows ending a prompt chunk (root at the chunk's last token, nothing to accept), rows that cannot accept, in
    a graph's layout (q tokens a row) and a packed one (rows of their own lengths)."""
    del dtype  # integer work
    g = torch.Generator().manual_seed(10)
    d, bs = 4, 4
    for lengths in ((7,) * 6, (7, 3, 12, 1, 9, 5)):
        b, q = len(lengths), max(lengths)
        row = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
        col = torch.cat([torch.arange(n) for n in lengths])
        t0 = torch.tensor([sum(lengths[:i]) for i in range(b)])
        tree = torch.rand(b, generator=g) < 0.6  # rows that verified a tree: root at 0
        base = torch.where(tree, 0, torch.tensor(lengths) - 1)
        acc = torch.where(tree, torch.randint(0, d + 1, (b,), generator=g), 0)
        ok = torch.rand(b, generator=g) < 0.8
        path = torch.randint(1, 3, (b, d), generator=g).cumsum(dim=1)
        emitted = torch.randint(0, 100, (b, d + 1), generator=g)
        ext = torch.randint(100, 200, (b, q + 2), generator=g)
        start = torch.randint(0, 20, (b,), generator=g)
        tables = torch.randperm(64, generator=g)[:b * 10].view(b, 10)
        args = [x.to(device) for x in (ext, base, ok, acc, emitted, path, t0, start, row, col, tables)]
        got = tree_draft_inputs(*args, bs)
        ref = tree_draft_inputs_ref(*args, bs)
        for name, x, y in zip(("src", "pos", "slot", "ids0"), got, ref):
            assert torch.equal(x, y), f"tree draft inputs {name}, lengths {lengths}"


@kernel_check
def check_tree_expand(device, dtype):
    """One depth of a tree's expansion: children, their scores and parents, the next frontier and its states, from
    the root (one node a row) and from a frontier of k, k a power of two and not, over a vocabulary of a few
    blocks (the last partial), through the head's id table and without; rows hold exact ties (the lower index
    wins in both)."""
    g = torch.Generator().manual_seed(11)
    b, v, h = 3, 5000, 40
    for k, kf, mapped in ((4, 1, False), (4, 4, True), (3, 3, False)):
        logits = torch.randn(b * kf, v, generator=g)
        logits[:, 4321] = logits[:, 17] = logits.max(dim=1).values + 1  # a tie for the best, across blocks
        logits = logits.to(device, dtype)
        parent = Frontier(tok=torch.zeros(b, kf, dtype=torch.int64, device=device),
                          score=(-3 * torch.rand(b, kf, generator=g)).to(device),
                          ids=torch.randint(-1, 30, (b, kf), generator=g).to(device),
                          bits=torch.randint(0, 1 << 20, (b, kf), generator=g).to(device),
                          hidden=torch.randn(b, kf, h, generator=g).to(device, dtype))
        ids = torch.randperm(3 * v, generator=g)[:v].to(device) if mapped else None
        c = 5 + kf * k
        outs = []
        for fn in (expand_depth, expand_depth_ref):
            cand = (torch.full((b, c), -7, dtype=torch.int64, device=device),
                    torch.zeros(b, c, device=device), torch.full((b, c), -7, dtype=torch.int64, device=device))
            outs.append((fn(logits, parent, k, ids, 5, *cand), cand))
        (got, gc), (ref, rc) = outs
        for name in ("tok", "ids", "bits", "hidden"):
            assert torch.equal(getattr(got, name), getattr(ref, name)), f"tree expand {name}, k {k} kf {kf}"
        assert torch.allclose(got.score, ref.score, atol=1e-5), f"tree expand scores, k {k} kf {kf}"
        assert torch.equal(gc[0], rc[0]) and torch.equal(gc[2], rc[2]), f"tree expand candidates, k {k} kf {kf}"
        assert torch.allclose(gc[1], rc[1], atol=1e-5), f"tree expand candidate scores, k {k} kf {kf}"
        assert (rc[0][:, 5:] >= 0).all() and (rc[0][:, :5] == -7).all(), "only this depth's candidates written"
    # near-certain children (one logit far above the rest): rounded, a child must still score at most its parent,
    # or the selection could take it without its parent
    rows = 32
    logits = torch.randn(rows * 4, 1000, generator=g)
    logits[torch.arange(rows * 4), torch.randint(0, 1000, (rows * 4,), generator=g)] += 30
    parent = Frontier(tok=torch.zeros(rows, 4, dtype=torch.int64, device=device),
                      score=(-3 * torch.rand(rows, 4, generator=g)).to(device),
                      ids=torch.zeros(rows, 4, dtype=torch.int64, device=device),
                      bits=torch.zeros(rows, 4, dtype=torch.int64, device=device),
                      hidden=torch.zeros(rows, 4, 8, device=device, dtype=dtype))
    cand = (torch.zeros(rows, 16, dtype=torch.int64, device=device), torch.zeros(rows, 16, device=device),
            torch.zeros(rows, 16, dtype=torch.int64, device=device))
    expand_depth(logits.to(device, dtype), parent, 4, None, 0, *cand)
    assert (cand[1] <= parent.score.repeat_interleave(4, dim=1)).all(), "a child scored above its parent"


@kernel_check
def check_tree_select(device, dtype):
    """Exact: the next tree's nodes and parent columns chosen from a real expansion's candidates (random logits,
    k = 3 over depths 1-4, several rows; two candidates of one depth given the same score), n a power of two and
    not, the depth table shared by the rows (a broadcast view) and a row each."""
    del dtype  # float32 scores
    g = torch.Generator().manual_seed(12)
    b, k, v, steps = 4, 3, 50, 4
    c = k + (steps - 1) * k * k
    cand = (torch.empty(b, c, dtype=torch.int64), torch.empty(b, c), torch.empty(b, c, dtype=torch.int64))
    f = Frontier(tok=torch.zeros(b, 1, dtype=torch.int64), score=torch.zeros(b, 1),
                 ids=torch.full((b, 1), -1), bits=torch.zeros(b, 1, dtype=torch.int64), hidden=torch.zeros(b, 1, 2))
    f = expand_depth_ref(torch.randn(b, v, generator=g), f, k, None, 0, *cand)
    for depth in range(1, steps):
        f = expand_depth_ref(torch.randn(b * k, v, generator=g), f, k, None, k + (depth - 1) * k * k, *cand)
    cand[1][:, k + 5] = cand[1][:, k + 2]  # a tie at depth 2
    depth = torch.tensor([[1] * k + [d + 1 for d in range(1, steps) for _ in range(k * k)]])
    tok, score, par = (x.to(device) for x in cand)
    for n in (7, 16):
        for dep in (depth.to(device).expand(b, -1), depth.repeat(b, 1).to(device)):
            got = select_tree(tok, par, score, dep, n)
            ref = select_tree_ref(tok, par, score, dep, n)
            assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1]), f"tree selection, n {n}"
            assert (ref[1][:, 0] == 0).all() and (ref[1] < torch.arange(1, n + 1, device=device)).all()


@kernel_check
def check_tree_attention_layout(device, dtype):
    """Exact: node positions by depth (in place) and ancestor bits of random trees of up to 63 nodes, rows with all,
    some and none of their nodes live, layouts wider than the root and nodes and narrower (a one-row prefill)."""
    del dtype  # integer work
    g = torch.Generator().manual_seed(13)
    for b, n, q, depth in ((5, 7, 8, 4), (4, 24, 30, 6), (3, 63, 64, 16), (2, 12, 5, 5)):
        par = torch.zeros(b, n, dtype=torch.int64)
        dep = torch.zeros(b, n + 1, dtype=torch.int64)
        for c in range(1, n + 1):  # a node's parent: an earlier column no deeper than depth - 1
            ok = (dep[:, :c] < depth).float() + 1e-9
            par[:, c - 1] = torch.multinomial(ok, 1, generator=g)[:, 0]
            dep[:, c] = dep.gather(1, par[:, c - 1:c])[:, 0] + 1
        nd = torch.randint(0, n + 1, (b,), generator=g)
        nd[0] = n
        start = torch.randint(0, 100, (b,), generator=g)
        pos = torch.randint(0, 1000, (b, q), generator=g)
        args = [x.to(device) for x in (par, nd, start)]
        got_pos, ref_pos = pos.clone().to(device), pos.clone().to(device)
        got = tree_attention_layout(*args, got_pos, depth)
        ref = tree_attention_layout_ref(*args, ref_pos, depth)
        assert torch.equal(got_pos, ref_pos), f"tree positions, n {n} q {q}"
        assert torch.equal(got[0], ref[0]) and torch.equal(got[0], pos.to(device)), f"positions before, n {n}"
        assert torch.equal(got[1], ref[1]), f"tree bits, n {n} q {q}"
        assert not torch.equal(ref_pos, pos.to(device)), "the check should move some position"
    # a live node whose parent is a stale value past the row's columns: the walk ends there (nothing read past the
    # row), and the other rows are as the reference lays them out
    par = torch.arange(6).repeat(2, 1)
    par[1, 2] = 1 << 40
    nd, start, pos = torch.tensor([6, 6]), torch.tensor([10, 20]), torch.arange(14).view(2, 7) + 100
    got_pos = pos.clone().to(device)
    got = tree_attention_layout(par.to(device), nd.to(device), start.to(device), got_pos, 6)
    ref_pos = pos[:1].clone().to(device)
    ref = tree_attention_layout_ref(par[:1].to(device), nd[:1].to(device), start[:1].to(device), ref_pos, 6)
    assert torch.equal(got_pos[:1], ref_pos) and torch.equal(got[1][:1], ref[1]), "tree layout beside a stale parent"


TREE_CHECKS = [check_tree_accept, check_tree_compact, check_tree_draft_inputs, check_tree_attention_layout,
               check_tree_expand, check_tree_select]
