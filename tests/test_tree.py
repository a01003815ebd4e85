"""Dynamic-tree speculation: greedy output equals plain decoding for trees of several shapes, EAGLE-3 and MTP-Eagle
heads, batches 1 / 3 / 8, chunked prefill and preemption; an oracle tree is accepted to its full depth (its path
hidden behind a wrong sibling at every depth, so its KV must move into place); a tree of one child per node is the
chain, token for token and count for count; sampled acceptance keeps the target's distribution (chi-square, with a
biased control that must fail)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from specserve import LLM, SamplingParams, SpeculativeConfig
from specserve.speculative.accept import AcceptInputs
from specserve.speculative.tree import TreeSpeculator, tree_layout
from specserve.speculative.tree_accept import accept_tree, compact_path_kv
from accept_helpers import chi2_critical, chi2_homogeneity, make_small_vocab, sample_replies
from tiny_models import PROMPTS, make_head, make_hf_model

N_OUT = 20
GREEDY = SamplingParams(temperature=0, max_tokens=N_OUT, ignore_eos=True)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tree")
    make_hf_model(root / "target", "llama", initializer_range=0.4, num_hidden_layers=4)
    make_head(root / "eagle3", root / "target", "eagle3", draft_vocab=150, seed=1)
    make_head(root / "mtp", root / "target", "mtp", num_modules=1, seed=2)
    return root


@pytest.fixture(scope="module")
def reference(dirs):
    llm = LLM(str(dirs / "target"), device="cpu", dtype="float32")
    return [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]


def _tree_llm(dirs, head: str, k: int, d: int, n: int, **kw) -> LLM:
    spec = dict(method="eagle3" if head == "eagle3" else "mtp", draft_model=str(dirs / head), max_draft_len=d,
                topk=k, max_total_draft_tokens=n)
    return LLM(str(dirs / "target"), device="cpu", dtype="float32", speculative_config=spec, **kw)


SHAPES = {"k2-d3-n6": (2, 3, 6), "k3-d2-n8": (3, 2, 8), "k4-d4-n12": (4, 4, 12)}


@pytest.mark.parametrize("head", ["eagle3", "mtp"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_greedy_tree_equals_plain_decoding(dirs, reference, head, shape):
    llm = _tree_llm(dirs, head, *SHAPES[shape])
    for n in (1, 3, 8):
        outs = llm.generate(PROMPTS[:n], GREEDY)
        assert [o.token_ids for o in outs] == reference[:n]
    assert llm.engine.spec_stats.num_verify_steps > 0
    assert llm.engine.pool.num_free == llm.engine.pool.num_usable


@pytest.mark.parametrize("kw", [dict(max_num_batched_tokens=7), dict(block_size=4, num_kv_blocks=48)],
                         ids=["chunked", "preempting"])
def test_greedy_tree_under_chunking_and_preemption(dirs, reference, kw):
    llm = _tree_llm(dirs, "eagle3", 2, 3, 6, **kw)
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == reference
    if "num_kv_blocks" in kw:
        assert sum(o.metrics.num_preemptions for o in outs) > 0
    assert llm.engine.pool.num_free == llm.engine.pool.num_usable


def _oracle(llm: LLM, reference, depth: int) -> None:
    """Replace each drafted tree with two nodes per depth: a wrong token first, then the target's own continuation
    (its parent the right node above), so acceptance takes the second sibling at every depth."""
    full = {tuple(llm.tokenizer.encode(p)): llm.tokenizer.encode(p) + r for p, r in zip(PROMPTS, reference)}
    vocab = llm.engine.model_config.vocab_size
    spec = llm.engine.runner.speculator
    draft = spec.draft

    def oracle(batch, hidden, aux, res):
        nodes, parents = draft(batch, hidden, aux, res)
        x = batch.spec
        last = (x.start + x.base_col + res.accepted).tolist()
        for i, s in enumerate(x.host_rows):
            right = full[tuple(s.request.prompt_token_ids)][last[i] + 2:last[i] + 2 + depth]
            right += [0] * (depth - len(right))
            for dd in range(1, depth + 1):
                par = 0 if dd == 1 else 2 * (dd - 1)
                nodes[i, 2 * dd - 2], nodes[i, 2 * dd - 1] = (right[dd - 1] + 1) % vocab, right[dd - 1]
                parents[i, 2 * dd - 2] = parents[i, 2 * dd - 1] = par
        return nodes, parents

    spec.draft = oracle


@pytest.mark.parametrize("head", ["eagle3", "mtp"])
def test_oracle_tree_is_accepted_to_its_full_depth(dirs, reference, head):
    d = 3
    llm = _tree_llm(dirs, head, 2, d, 2 * d)
    _oracle(llm, reference, d)
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == reference
    stats = llm.engine.spec_stats
    assert stats.per_position == [1.0] * d  # every verified tree's path reached its full depth
    assert stats.acceptance_length > d  # D + 1 a step but near the end, where fewer depths fit


def test_without_moving_the_path_kv_outputs_break(dirs, reference, monkeypatch):
    """The control of the oracle test: the accepted path's nodes sit at columns 2, 4, 6; if their KV stayed there,
    the next steps would read a wrong token's KV at positions start + 1.."""
    import specserve.speculative.tree as tree

    monkeypatch.setattr(tree, "compact_path_kv", lambda *a, **k: None)
    llm = _tree_llm(dirs, "eagle3", 2, 3, 6)
    _oracle(llm, reference, 3)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] != reference


def _chain_through_tree_code(llm: LLM) -> None:
    """Swap the engine's chain speculator for the tree one with topk = 1 (the same D, slots and result sizes)."""
    eng = llm.engine
    old = eng.runner.speculator
    cfg = eng.model_config
    tree = TreeSpeculator(eng.model, eng.head, old.drafter.head_kv, eng.kv_cache.tensor[:cfg.num_hidden_layers],
                          eng.spec_config, eng.kv_cache.block_size)
    eng.runner.speculator = tree


@pytest.mark.parametrize("head", ["eagle3", "mtp"])
def test_a_tree_of_one_child_per_node_is_the_chain(dirs, head):
    """topk = 1 through the tree's code (one child per node, N = D) gives the chain's tokens and counts, greedy
    and seeded sampling."""
    spec = dict(method="eagle3" if head == "eagle3" else "mtp", draft_model=str(dirs / head), max_draft_len=3)
    params = [SamplingParams(temperature=0, max_tokens=N_OUT, ignore_eos=True),
              SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=N_OUT, ignore_eos=True)]
    runs = []
    for through_tree in (False, True):
        llm = LLM(str(dirs / "target"), device="cpu", dtype="float32", speculative_config=spec)
        if through_tree:
            _chain_through_tree_code(llm)
        outs = llm.generate(PROMPTS, [params[i % 2] for i in range(len(PROMPTS))])
        runs.append(([o.token_ids for o in outs], llm.engine.spec_stats.as_dict()))
    assert runs[0] == runs[1]


@pytest.mark.parametrize("head", ["eagle3", "mtp"])
def test_a_trees_chain_steps_are_the_chain(dirs, head, monkeypatch):
    """A tree engine's steps that draft a chain (here every step: ``tree_max_batch_size`` 0) draft what the chain
    engine of the same D drafts, through the head's argmax rather than the tree's ranking (which they never run):
    step by step the same drafts, and the same tokens and counts."""
    import specserve.speculative.tree as tree_module

    def no_ranking(*args, **kwargs):
        raise AssertionError("a chain step ran the tree's expansion")

    monkeypatch.setattr(tree_module, "expand_depth", no_ranking)
    monkeypatch.setattr(tree_module, "select_tree", no_ranking)
    spec = dict(method="eagle3" if head == "eagle3" else "mtp", draft_model=str(dirs / head), max_draft_len=3)
    runs = []
    for topk in (1, 3):
        llm = LLM(str(dirs / "target"), device="cpu", dtype="float32",
                  speculative_config=dict(spec, topk=topk) if topk > 1 else spec)
        llm.engine.spec_config.tree_max_batch_size = 0
        sp, drafts = llm.engine.runner.speculator, []
        results = sp.results
        sp.results = lambda *a, **kw: [drafts.append(r.drafts) or r for r in results(*a, **kw)]
        outs = llm.generate(PROMPTS, GREEDY)
        runs.append(([o.token_ids for o in outs], llm.engine.spec_stats.as_dict(), drafts))
    assert isinstance(sp, TreeSpeculator)
    assert sum(len(d) == 3 for d in runs[1][2]) > 20  # chains of D drafts
    assert runs[0] == runs[1]


def test_tree_acceptance_on_a_hand_built_tree():
    """Root argmax 5; nodes (col: token <- parent): 1: 4<-0, 2: 5<-0, 3: 7<-2, 4: 6<-2, 5: 9<-4. The argmax at
    column 2 is 6 and at column 4 is 9: the path is 2 -> 4 -> 5, three deep, and the bonus the argmax at 5."""
    v = 12
    argmax = [5, 0, 6, 0, 9, 3]
    logits = torch.full((1, 6, v), -5.0)
    for c, t in enumerate(argmax):
        logits[0, c, t] = 5.0
    nodes = torch.tensor([[4, 5, 7, 6, 9]])
    parents = torch.tensor([[0, 0, 2, 2, 4]])
    acc = AcceptInputs(sampling=None, greedy=torch.tensor([True]), can_accept=torch.tensor([True]),
                       relaxed=torch.tensor([False]), relaxed_topk=torch.tensor([1]),
                       relaxed_delta=torch.tensor([0.0]), thinking=torch.tensor([False]), simple_greedy=True)
    res = accept_tree(logits, nodes, parents, torch.tensor([5]), 3, 2, acc)
    assert res.accepted.tolist() == [3] and res.path.tolist() == [[2, 4, 5]]
    assert res.emitted.tolist() == [[5, 6, 9, 3]]
    short = accept_tree(logits, nodes, parents, torch.tensor([4]), 3, 2, acc)  # node 5 not verified
    assert short.accepted.tolist() == [2] and short.emitted.tolist() == [[5, 6, 9, 0]]
    depth, bits = tree_layout([0, 0, 2, 2, 4])
    assert depth == [0, 1, 1, 2, 2, 3] and bits[5] == 0b110101


def test_the_path_kv_moves_to_the_positions_after_the_root():
    kv = torch.arange(2 * 2 * 2 * 4, dtype=torch.float32).view(2, 2, 2, 4, 1, 1)  # 2 layers, k/v, 2 blocks of 4
    before = kv.clone()
    tables = torch.tensor([[1, 0]])  # positions 0..3 in block 1
    compact_path_kv(kv, tables, torch.tensor([0]), torch.tensor([[2, 3]]), torch.tensor([2]), 4)
    for layer in range(2):
        for j in range(2):  # position 1 <- column 2, position 2 <- column 3, in every layer's K and V
            got, old = kv[layer, j, 1].view(-1).tolist(), before[layer, j, 1].view(-1).tolist()
            assert got == [old[0], old[2], old[3], old[3]]
    assert torch.equal(kv[:, :, 0], before[:, :, 0])  # the other block untouched


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory):
    return make_small_vocab(tmp_path_factory.mktemp("tree_sampled"))


def _first_tokens(root, tree: bool, n: int, biased: bool = False) -> tuple[Counter, float]:
    spec = dict(max_draft_len=2, topk=3, max_total_draft_tokens=6, tree_max_batch_size=512) if tree else None
    outs, stats = sample_replies(root, spec, n, [1, 2, 3], seed=1000, biased=biased)
    return Counter(tuple(o.token_ids[1:3]) for o in outs), (stats.acceptance_length - 1) if tree else 0.0


def test_sampled_tree_acceptance_keeps_the_distribution(small_vocab):
    """Tokens 2 and 3 of 3-token replies (the first is the prefill's sample, the second and third a tree step's)
    under plain sampling and tree speculation: one distribution (chi-square); removing rejected siblings from the
    residual is what makes it so (the biased control must fail)."""
    n = 4000
    plain, _ = _first_tokens(small_vocab, False, n)
    tree, accepted = _first_tokens(small_vocab, True, n)
    assert accepted > 0.2  # siblings are accepted often enough for the test to bite
    stat, dof = chi2_homogeneity(plain, tree)
    assert stat < chi2_critical(dof), (stat, dof)
    biased, _ = _first_tokens(small_vocab, True, n, biased=True)
    stat_b, dof_b = chi2_homogeneity(plain, biased)
    assert stat_b > chi2_critical(dof_b), (stat_b, dof_b)


def test_tree_settings_are_checked():
    spec = SpeculativeConfig.from_value(dict(draft_model="random", num_speculative_tokens=4, eagle_topk=3))
    assert (spec.max_draft_len, spec.topk, spec.max_total_draft_tokens, spec.verify_len) == (4, 3, 12, 13)
    assert spec.lookahead_slots == 9 and spec.tree
    chain = SpeculativeConfig(draft_model="random", max_draft_len=4)
    assert (chain.verify_len, chain.lookahead_slots, chain.kv_slots_past_len) == (5, 3, 8) and not chain.tree
    for bad, match in ((dict(topk=0), "topk"), (dict(topk=2, max_total_draft_tokens=3), "max_total_draft_tokens"),
                       (dict(topk=1, max_total_draft_tokens=6), "needs topk"),
                       (dict(topk=2, max_total_draft_tokens=64), "max_total_draft_tokens"),
                       (dict(topk=2, max_draft_len=2, max_total_draft_tokens=7), "candidates"),
                       (dict(topk=2, forced_acceptance=1.0), "relaxed and forced"),
                       (dict(topk=2, method="mtp", mtp_eagle=False), "vanilla")):
        with pytest.raises(ValueError, match=match):
            SpeculativeConfig(**{"draft_model": "random", "max_draft_len": 4, **bad})
    with pytest.raises(ValueError, match="both"):
        SpeculativeConfig.from_value(dict(draft_model="random", topk=2, eagle_topk=3))
    # vLLM's and TensorRT-LLM's spellings of the head's folder
    for key in ("model", "speculative_model_dir"):
        assert SpeculativeConfig.from_value({key: "random", "method": "eagle3"}).draft_model == "random"
    with pytest.raises(ValueError, match="both"):
        SpeculativeConfig.from_value(dict(draft_model="random", model="other"))
    with pytest.raises(ValueError, match="both model='a' and speculative_model_dir='b'"):  # as the user spelled them
        SpeculativeConfig.from_value(dict(model="a", speculative_model_dir="b"))


@pytest.mark.parametrize("head,shape", [("eagle3", (2, 3, 6)), ("mtp", (2, 3, 6)), ("eagle3", (4, 4, 20))],
                         ids=["eagle3", "mtp", "eagle3-k4-d4-n20"])
def test_tree_graph_layouts_equal_packed_steps(dirs, reference, head, shape):
    """Tree steps in the CUDA graphs' padded layouts (run without capture on the CPU): positions by depth and
    ancestor bits derived on the device from the staged parents; the same tokens as packed steps, greedy and
    seeded, and an oracle tree still accepted to its full depth. A tree of 20 nodes is wider than a short
    prompt's 16-token prefill layout (whose row has no nodes)."""
    k, d, n = shape
    from specserve.runner.cuda_graph import CudaGraphs

    params = [SamplingParams(temperature=0, max_tokens=N_OUT, ignore_eos=True),
              SamplingParams(temperature=0.8, top_k=20, seed=4, max_tokens=N_OUT, ignore_eos=True)]
    params = [params[i % 2] for i in range(len(PROMPTS))]
    outs = []
    for padded in (False, True):
        llm = _tree_llm(dirs, head, k, d, n)
        if padded:
            llm.engine.runner.graphs = CudaGraphs(8, llm.engine.runner._staging_buffers(), capture=False)
        outs.append([o.token_ids for o in llm.generate(PROMPTS, params)])
        if padded:
            assert llm.engine.runner.graphs.steps >= 10
            # one request at a time: each prompt's prefill is a one-row layout of 16 or 32 tokens
            assert [llm.generate([p], GREEDY)[0].token_ids for p in PROMPTS[:3]] == reference[:3]
    assert outs[0] == outs[1]
    llm = _tree_llm(dirs, head, k, d, n)
    llm.engine.runner.graphs = CudaGraphs(8, llm.engine.runner._staging_buffers(), capture=False)
    _oracle(llm, reference, d)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == reference
    assert llm.engine.spec_stats.per_position == [1.0] * d


def test_steps_of_many_rows_draft_chains(dirs, reference):
    """Past ``tree_max_batch_size`` rows a step drafts a chain through the tree's code: the next step's graph
    layout is 1 + D tokens a row, the output is still plain decoding's, and steps of few rows draft trees again
    (the last requests of a batch)."""
    from specserve.runner.cuda_graph import CudaGraphs

    llm = _tree_llm(dirs, "eagle3", 3, 3, 9, max_num_batched_tokens=512)
    llm.engine.spec_config.tree_max_batch_size = 3
    runner = llm.engine.runner
    runner.graphs = CudaGraphs(8, runner._staging_buffers(), capture=False)
    pick, qs = runner.graph_layout, []
    runner.graph_layout = lambda batch: qs.append((len(batch.scheduled), pick(batch))) or qs[-1][1]
    params = [SamplingParams(temperature=0, max_tokens=6 + 2 * i, ignore_eos=True) for i in range(len(PROMPTS))]
    outs = llm.generate(PROMPTS, params)
    assert [o.token_ids for o in outs] == [r[:6 + 2 * i] for i, r in enumerate(reference)]
    gen = [(rows, lay.q) for rows, lay in qs if lay is not None and not lay.prefill]
    assert any(q == 4 for rows, q in gen if rows > 3)  # chains: 1 + D
    assert any(q == 10 for rows, q in gen if rows <= 3)  # trees again: 1 + N
