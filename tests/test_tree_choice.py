"""Tree or chain by measured cost (``speculative/tree_choice.py``): the choice on synthetic costs and acceptance,
its optimistic start and probes, the measured tree's shape, the costs measured through the engine's own steps,
and greedy output equal to plain decoding while steps switch between the tree and the chain at random."""

from __future__ import annotations

import random

import pytest

from specserve import LLM, SamplingParams, SpeculativeConfig
from specserve.core.metrics import Tally, Verified
from specserve.runner.cuda_graph import GraphCheck
from specserve.speculative.draft_len import CAPTURE_SECONDS, PROBE_AFTER, PROBE_MAX
from specserve.speculative.step_costs import StepCosts, load_or_measure_costs
from specserve.speculative.tree import tree_layout
from specserve.speculative.tree_choice import CHAIN, TREE, WINDOW, TreeChoice, measurement_tree
from test_tree import _tree_llm as tree_llm, dirs  # noqa: F401 (dirs: test_tree's target and heads)
from tiny_models import PROMPTS

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
D, N = 4, 12


def _choice(**kw) -> TreeChoice:
    """A choice whose costs stay as set: no observed periods (these loops run far faster than any step)."""
    c = TreeChoice(SpeculativeConfig(draft_model="random", max_draft_len=D, topk=3, max_total_draft_tokens=N,
                                     **kw))
    c.timed = False
    return c


def _steps(choice: TreeChoice, tree: bool, accepted: int, n: int = 1, rows: int = 1) -> None:
    """``n`` collected steps of ``rows`` rows that verified the tree (N nodes, depth D) or a chain, each
    accepting ``accepted`` drafts."""
    for _ in range(n):
        choice.observe(Tally({Verified(N if tree else D, accepted, accepted + 1, D): rows}))


@pytest.mark.parametrize("shape", [(2, 3, 6), (2, 4, 7), (3, 5, 7), (4, 6, 24), (8, 8, 48), (3, 2, 12), (8, 2, 63)])
def test_the_measured_tree_is_one_the_expansion_could_draft(shape):
    k, d, n = shape
    parents = measurement_tree(k, d, n)
    depth, _ = tree_layout(parents)
    assert len(parents) == n and all(p < c for c, p in enumerate(parents, start=1))
    assert max(depth) <= d and depth[1:] == sorted(depth[1:])  # sorted by depth, as the selection leaves them
    assert max(parents.count(p) for p in set(parents)) <= k
    for level in range(1, max(depth)):  # only the first k nodes of a depth have children
        cols = [c for c in range(1, n + 1) if depth[c] == level]
        assert {p for p in parents if p in cols} <= set(cols[:k])


def test_the_choice_weighs_acceptance_against_measured_costs():
    """The H100's figures: at batch 1 a 4x6x24 tree step cost 2.4x a chain step's and accepted 4.1 tokens to the
    chain's 2.5 (a tree of lower cost pays, that one does not); at 32 rows it cost 1.9x for 2.8 tokens (chain)."""
    c = _choice()
    c.costs = StepCosts([1, 32], [[0.69e-3, 1.0e-3], [1.69e-3, 3.26e-3]])
    _steps(c, False, 2, 200)  # the chain: ~2.5 tokens
    _steps(c, True, 3, 100)
    _steps(c, True, 4, 100)  # the tree: 4.5 tokens
    tok = c.expected_tokens()
    assert tok[0] == pytest.approx(3.0, abs=0.05) and tok[1] == pytest.approx(4.5, abs=0.05)
    assert c.choose([None]) == N  # 4.5 / 1.0 beats 3.0 / 0.69
    assert c.choose([None] * 32) == D  # 4.5 / 3.26 loses to 3.0 / 1.69
    c.costs = StepCosts([1], [[0.69e-3, 1.2e-3]])  # a dearer tree: 4.5 / 1.2 loses at batch 1 too
    assert c.choose([None]) == D
    with pytest.raises(ValueError, match="two kinds"):
        c.costs = StepCosts([1], [[1.0, 1.0, 1.0]])


def test_each_kind_is_tried_early_and_kept_only_while_its_counts_bear_it_out():
    """Both kinds start optimistic (every depth accepted): the cheaper chain goes first; once its counts show
    little acceptance the tree (still at its prior) is tried, and dropped again when its own counts show no more;
    a tree that accepts well is kept."""
    c = _choice()
    c.costs = StepCosts([4], [[1.0, 1.5]])
    rows = [None] * 4
    assert c.choose(rows) == D
    _steps(c, False, 0, 8, rows=4)  # the chain accepts nothing
    assert c.choose(rows) == N  # 5 / 1.5 over ~1.5 / 1.0
    _steps(c, True, 0, 20, rows=4)
    assert c.choose(rows) == D
    good = _choice()
    good.costs = StepCosts([4], [[1.0, 1.5]])
    _steps(good, False, 1, 50, rows=4)
    _steps(good, True, 4, 50, rows=4)
    assert {good.choose(rows, True) for _ in range(10)} == {N}


def test_the_unchosen_kind_is_probed_with_a_doubling_wait():
    c = _choice()
    c.costs = StepCosts([1], [[1.0, 1.5]])
    _steps(c, False, 0, 100)
    _steps(c, True, 4, 100)
    assert {c.choose([None]) for _ in range(3 * PROBE_AFTER)} == {N}  # prompt steps never probe
    chosen = [c.choose([None], True) for _ in range(8 * PROBE_AFTER)]
    probes = [i for i, x in enumerate(chosen) if x == D]
    assert probes == [PROBE_AFTER - 1, 3 * PROBE_AFTER - 1, 7 * PROBE_AFTER - 1]
    assert c.probe_after == 8 * PROBE_AFTER
    _steps(c, True, 0, 2000)  # the tree stops paying: the choice moves and the wait starts over
    assert c.choose([None], True) == D and c.probe_after == PROBE_AFTER
    for _ in range(20):
        c.run = c.probe_after
        c.choose([None], True)
    assert c.probe_after == PROBE_MAX


def test_the_kind_with_graphs_runs_until_a_capture_has_paid_and_probes_wait_for_theirs():
    """A step whose better kind (the tree) lacks a graph it would run takes the chain, whose graphs exist, until
    the seconds that loses reach a capture's (``CAPTURE_SECONDS``); switching needs the switch step's graph (the
    width the rows verify, the new kind's drafting) and the new kind's own; a probe needs its step's graph and the
    step's after it (back, at the probed kind's width); an engine running no graphs probes on time."""
    c = _choice()
    c.costs = StepCosts([1], [[1e-3, 1.5e-3]])
    _steps(c, False, 0, 100)
    _steps(c, True, 4, 100)  # the tree: 5 tokens / 1.5 ms against about 1 / 1 ms

    def check(*have):  # the (q, drafts) graphs of the step's rows that exist
        return GraphCheck(lambda s: (1 + s, s) in have, lambda: ("layout", 1), runs=lambda q, s: (q, s) in have)

    chain, tree = (1 + D, D), (1 + N, N)
    to_tree, to_chain = (1 + D, N), (1 + N, D)  # switch steps: one kind's width, the other's drafting
    # rows verifying chains, the tree's own graph there but not the switch step's: the chain runs until paid
    kinds = [c.choose([None], True, check(chain, tree), D) for _ in range(1000)]
    rented = kinds.index(N)
    lost = 1e-3 * (1 - c.expected_tokens()[0] / 1e-3 / (c.expected_tokens()[1] / 1.5e-3))
    assert abs(rented - CAPTURE_SECONDS / lost) <= 1 and set(kinds[:rented]) == {D} and c.rent.owed
    # at a chain's width the switch step's graph decides: without it the debt stands, with it it is paid (the
    # chain's probe, waiting for that graph since, held off here)
    c.run = 0
    assert c.choose([None], True, check(chain, tree), D) == N and c.rent.owed
    assert c.choose([None], True, check(chain, tree, to_tree), D) == N and not c.rent.owed
    c.run, c.probe_after = 0, PROBE_AFTER
    kinds = [c.choose([None], True, check(chain, tree, to_chain), N) for _ in range(2 * PROBE_AFTER)]
    assert set(kinds) == {N}  # rows verifying trees: the step back after a chain probe has no graph, so it waits
    c.run = PROBE_AFTER  # and a step that lacks the probe's own graph (a tree's width, drafting a chain) waits too
    assert c.choose([None], True, check(chain, tree, to_tree), N) == N
    assert c.choose([None], True, check(chain, tree, to_chain, to_tree), N) == D  # a step with both probes
    c.run = c.probe_after - 1
    assert c.choose([None], True, GraphCheck(lambda s: False, graphed=False), N) == D
    # the chain the better kind: at a tree's width the switch step (drafting a chain) lacks its graph, so the
    # tree is rented, and at a chain's width (its own graphs there) the chain runs
    worse = _choice()
    worse.costs = StepCosts([1], [[1e-3, 1.5e-3]])
    _steps(worse, False, 4, 100)
    _steps(worse, True, 0, 100)
    assert worse.choose([None], True, check(chain, tree, to_tree), N) == N and worse.rent.owed
    assert worse.choose([None], True, check(chain, tree, to_tree), D) == D
    assert GraphCheck(lambda s: s == D).graph_runs(1 + D, D) and not GraphCheck(lambda s: True).graph_runs(9, D)


def test_counts_follow_the_recent_steps():
    """A kind's counts are halved past ``WINDOW`` rows: a tree that accepted everything for long and nothing since
    is judged mostly by the recent steps."""
    c = _choice()
    _steps(c, True, D, WINDOW)
    _steps(c, True, 0, 2 * WINDOW)
    assert c.counts[1].rows <= WINDOW and c.expected_tokens()[1] < 1.5


def test_a_tree_of_depth_many_nodes_still_drafts_a_tree(dirs):
    """N = D: the tree verifies as many tokens as the chain, so nothing is measured and the fixed rule drafts the
    tree (its topk children a node) at few rows."""
    c = TreeChoice(SpeculativeConfig(draft_model="random", max_draft_len=3, topk=2, max_total_draft_tokens=3))
    assert c.options() is None and c.choose([None]) == 3 and c.kind == TREE
    plain = LLM(str(dirs / "target"), device="cpu", dtype="float32")
    reference = [o.token_ids for o in plain.generate(PROMPTS[:3], GREEDY)]
    llm = _tree_llm(dirs, n=3)
    spec, topks = llm.engine.runner.speculator, []
    plan = spec.plan_step

    def spy(sched, draft_len=None, captured=None):
        out = plan(sched, draft_len, captured)
        topks.append(spec.step_topk)
        return out

    spec.plan_step = spy
    assert spec.cost_options(True) is None
    assert [o.token_ids for o in llm.generate(PROMPTS[:3], GREEDY)] == reference
    assert set(topks) == {3}


def test_without_costs_the_fixed_rule_holds_and_the_options_are_a_chain_and_the_tree():
    c = _choice()  # tree_max_batch_size None: costs measured where the engine has graphs, TREE_MAX_BATCH elsewhere
    assert [c.choose([None] * b) for b in (1, 8, 9)] == [N, N, D]
    fixed = _choice(tree_max_batch_size=2)
    assert [fixed.choose([None] * b) for b in (2, 3)] == [N, D]
    opts = c.options()
    assert list(opts) == [D, N] and opts[D] == [0, 1, 2, 3] and opts[N] == measurement_tree(3, D, N)
    with pytest.raises(ValueError, match="step_cost_file"):
        SpeculativeConfig(draft_model="random", topk=2, tree_max_batch_size=8, step_cost_file="x.json")
    SpeculativeConfig(draft_model="random", topk=2, step_cost_file="x.json")


def _tree_llm(dirs, n: int = 8, **kw) -> LLM:
    """test_tree's EAGLE-3 tree engine, depth 3, topk 3, ``n`` nodes."""
    return tree_llm(dirs, "eagle3", 3, 3, n, **kw)


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
@pytest.mark.parametrize("graphs", [False, True], ids=["packed", "graph-layouts"])
def test_greedy_output_is_plain_while_steps_switch_between_tree_and_chain(dirs, overlap, graphs):
    plain = LLM(str(dirs / "target"), device="cpu", dtype="float32")
    reference = [o.token_ids for o in plain.generate(PROMPTS, GREEDY)]
    llm = _tree_llm(dirs, overlap_scheduler=overlap)
    runner = llm.engine.runner
    if graphs:
        from specserve.runner.cuda_graph import CudaGraphs

        runner.graphs = CudaGraphs(8, runner._staging_buffers(), capture=False)
    policy, rng, chosen = llm.engine.draft_policy, random.Random(7), []
    choose = policy.choose

    def random_kind(requests, generation=False, captured=None, verifying=0):
        choose(requests, generation, captured, verifying)  # the policy's own bookkeeping runs too
        policy.kind = rng.choice([CHAIN, TREE])
        chosen.append(policy.kind)
        return 8 if policy.kind == TREE else 3

    policy.choose = random_kind
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == reference
    assert {CHAIN, TREE} <= set(chosen)
    chain, tree = policy.counts
    assert chain.rows > 0 and tree.rows > 0  # observed by kind of step
    assert llm.engine.pool.num_free == llm.engine.pool.num_usable
    assert not graphs or runner.graphs.steps > 0  # the graph layouts ran (rows that fit no graph run packed)


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_the_graph_a_step_runs_is_the_one_its_choice_asked_about(dirs, overlap):
    """Switching between tree and chain, a generation step runs the graph that ``GraphCheck.runs`` asks the graphs
    about for the width its rows verify (``verifying``: the kind the step before drafted) and the drafting it
    chose, the question the choice's rent and probes put."""
    from specserve.runner.cuda_graph import CudaGraphs, graph_check

    llm = _tree_llm(dirs, overlap_scheduler=overlap)
    runner, spec = llm.engine.runner, llm.engine.runner.speculator
    runner.graphs = graphs = CudaGraphs(8, runner._staging_buffers(), capture=False)
    policy, rng, steps, ran = llm.engine.draft_policy, random.Random(3), [], []
    choose, run, launch, has = policy.choose, graphs.run, runner.launch, graphs.has

    def random_kind(requests, generation=False, captured=None, verifying=0):
        choose(requests, generation, captured, verifying)
        policy.kind = rng.choice([CHAIN, TREE])
        drafts = policy.num_nodes if policy.kind == TREE else policy.draft_len
        q = 1 + (policy.num_nodes if verifying > policy.draft_len else policy.draft_len)
        asked = []
        graphs.has = lambda kind: asked.append(kind) or has(kind)
        graph_check(graphs, captured.layout, spec.graph_switches).runs(q, drafts)  # a fresh check: no memo
        graphs.has = has
        steps.append(asked[0] if generation and isinstance(captured.layout(), tuple) else None)
        return drafts

    def launched(batch, draft_len=None):
        ran.clear()
        out = launch(batch, draft_len)
        steps[-1] = (steps[-1], list(ran))
        return out

    policy.choose, runner.launch = random_kind, launched
    graphs.run = lambda key, *a, **kw: ran.append(key.kind) or run(key, *a, **kw)
    llm.generate(PROMPTS, GREEDY)
    pairs = [(asked, kinds[0]) for asked, kinds in steps if asked is not None]
    assert len(pairs) > 10 and all(asked == first for asked, first in pairs)
    switches = {(asked[0].q, asked[2]) for asked, _ in pairs}
    assert {(1 + policy.draft_len, 3), (1 + policy.num_nodes, 1)} <= switches  # both kinds of switch step ran


def test_the_engine_measures_a_tree_step_and_a_chain_step_per_batch_bucket(dirs, tmp_path):
    """The costs a graph engine measures at start (graph layouts, run without capture on the CPU): two kinds of
    step per bucket, the blocks they took back in the pool, saved to and reloaded from the cost file, and the
    engine's output still plain greedy's with the choice weighing them."""
    plain = LLM(str(dirs / "target"), device="cpu", dtype="float32")
    reference = [o.token_ids for o in plain.generate(PROMPTS, GREEDY)]
    f = tmp_path / "costs.json"
    llm = _tree_llm(dirs, max_num_seqs=4)
    eng = llm.engine
    assert eng.draft_policy.costs is None  # no graphs on the CPU: the fixed rule
    spec = eng.runner.speculator
    assert spec.cost_options(False) is None and list(spec.cost_options(True)) == [3, 8]
    from specserve.runner.cuda_graph import CudaGraphs

    eng.runner.graphs = CudaGraphs(8, eng.runner._staging_buffers(), capture=False)  # the graph steps' layouts
    eng.spec_config.step_cost_file = str(f)
    costs = load_or_measure_costs(eng, spec.cost_options(True))
    assert costs.buckets == [1, 2, 4] and costs.max_draft_len == 1 and f.is_file()
    assert eng.pool.num_free == eng.pool.num_usable
    assert load_or_measure_costs(eng, spec.cost_options(True)) == costs  # read back, not measured again
    eng.draft_policy.costs = costs
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == reference
    assert sum(eng.spec_stats.steps_by_draft_len) > 0
