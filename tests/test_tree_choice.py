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
from specserve.speculative.tree_choice import TREE, WINDOW, TreeChoice, measurement_tree
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


def _costs(rows: list[int], chain: list[list[float]], tree: list[float]) -> StepCosts:
    """Step costs by rows: chains of 1..D drafts, then the tree."""
    return StepCosts(rows, [c + [t] for c, t in zip(chain, tree)])


def test_the_choice_weighs_acceptance_against_measured_costs():
    """The H100's figures at D = 4: at batch 1 a 4x6x24 tree step cost 2.4x a chain step's and accepted 4.1 tokens
    to the chain's 2.5 (a tree of lower cost pays, that one does not); at 32 rows each depth of a chain costs more,
    and a chain shorter than D takes most tokens a second where acceptance falls with depth."""
    c = _choice()
    c.costs = _costs([1, 32], [[0.66e-3, 0.67e-3, 0.68e-3, 0.69e-3], [1.3e-3, 1.6e-3, 1.9e-3, 2.2e-3]],
                     [1.0e-3, 3.26e-3])
    for accepted in range(D + 1):  # the chain: depth j accepted in (D + 1 - j) / (D + 1) of the rows
        _steps(c, False, accepted, 200)
    _steps(c, True, 3, 100)
    _steps(c, True, 4, 100)  # the tree: 4.5 tokens
    tok = c.expected_tokens()
    assert tok == pytest.approx([1.8, 2.4, 2.8, 3.0, 4.5], abs=0.02)
    assert c.choose([None]) == N and c.tree  # 4.5 / 1.0 beats 3.0 / 0.69
    assert c.choose([None] * 32) == 2 and not c.tree  # 2.4 / 1.6 beats 1.8 / 1.3, 2.8 / 1.9, the tree's 4.5 / 3.26
    c.costs = _costs([1], [[0.66e-3, 0.67e-3, 0.68e-3, 0.69e-3]], [1.2e-3])  # a dearer tree loses at batch 1 too
    assert c.choose([None]) == D
    with pytest.raises(ValueError, match="a column per option"):
        c.costs = StepCosts([1], [[1.0, 1.0]])


def test_each_kind_is_tried_early_and_kept_only_while_its_counts_bear_it_out():
    """Both kinds start optimistic (every depth accepted): the longest chain goes first; once its counts show
    little acceptance the tree (still at its prior) is tried, and dropped again for the shortest chain when its own
    counts show no more; a tree that accepts well is kept."""
    c = _choice()
    costs = _costs([4], [[0.85, 0.9, 0.95, 1.0]], [1.5])
    c.costs = costs
    rows = [None] * 4
    assert c.choose(rows) == D
    _steps(c, False, 0, 8, rows=4)  # the chain accepts nothing
    assert c.choose(rows) == N  # 5 / 1.5 over ~1.1 / 0.85
    _steps(c, True, 0, 20, rows=4)
    assert c.choose(rows) == 1  # nothing accepted anywhere: the cheapest chain
    good = _choice()
    good.costs = costs
    _steps(good, False, 1, 50, rows=4)
    _steps(good, True, 4, 50, rows=4)
    assert {good.choose(rows, True) for _ in range(10)} == {N}


def test_the_unchosen_kind_is_probed_with_a_doubling_wait():
    """Where the tree runs the best chain is probed (and the tree where a chain runs); moving between chain
    lengths does not restart the wait."""
    c = _choice()
    c.costs = _costs([1], [[0.9, 0.93, 0.97, 1.0]], [1.5])
    _steps(c, False, 0, 100)
    _steps(c, True, 4, 100)
    assert {c.choose([None]) for _ in range(3 * PROBE_AFTER)} == {N}  # prompt steps never probe
    chosen = [c.choose([None], True) for _ in range(8 * PROBE_AFTER)]
    probes = [i for i, x in enumerate(chosen) if x != N]
    assert probes == [PROBE_AFTER - 1, 3 * PROBE_AFTER - 1, 7 * PROBE_AFTER - 1]
    assert {chosen[i] for i in probes} == {1}  # the chain of most tokens a second: accepting nothing, the cheapest
    assert c.probe_after == 8 * PROBE_AFTER
    _steps(c, True, 0, 2000)  # the tree stops paying: the choice moves and the wait starts over
    assert c.choose([None], True) == 1 and c.probe_after == PROBE_AFTER
    _steps(c, False, D, 400)  # the chain accepts everything now: the longest, the same kind's wait goes on
    run = c.run
    assert c.choose([None], True) == D and c.run == run + 1
    for _ in range(20):
        c.run = c.probe_after
        c.choose([None], True)
    assert c.probe_after == PROBE_MAX


def test_each_option_runs_the_graph_its_widths_give():
    """A step runs as wide as its rows verify: a chain longer than chosen where they verify one, the tree's width
    where it drafts the tree or where they verify it (drafting a chain of D: the one switch graph)."""
    c = _choice()
    tree, chain = c.tree_option, lambda d: d - 1
    assert c.step_graph(1, tree) == c.step_graph(N, tree) == (1 + N, N)
    assert c.step_graph(3, chain(1)) == (4, 3) and c.step_graph(1, chain(3)) == (4, 3)
    assert c.step_graph(0, chain(2)) == (3, 2) and c.step_graph(N, chain(1)) == (1 + N, D)
    assert c._column_run(3, chain(1)) == chain(3) and c._column_run(2, tree) == tree
    assert c._column_run(N, chain(2)) == -1  # the switch step's period is no option's cost


def test_the_kind_with_graphs_runs_until_a_capture_has_paid_and_probes_wait_for_theirs():
    """A step whose better option (the tree) lacks a graph it would run takes the chain whose graphs exist, until
    the seconds that loses reach a capture's (``CAPTURE_SECONDS``); from the tree's width a chain needs the switch
    graph (drafting a chain of D there) and its own; a probe needs its step's graph and the step's after it (back,
    from the probed option's width); an engine running no graphs probes on time."""
    c = _choice()
    costs = _costs([1], [[0.9e-3, 0.95e-3, 1e-3, 1.05e-3]], [1.5e-3])
    c.costs = costs
    _steps(c, False, 0, 100)
    _steps(c, True, 4, 100)  # the tree: 5 tokens / 1.5 ms against about 1.04 / 0.9 ms (a chain of 1)

    def check(*have):  # the (q, drafts) graphs of the step's rows that exist
        return GraphCheck(lambda s: (1 + s, s) in have, lambda: ("layout", 1), runs=lambda q, s: (q, s) in have)

    one, four, tree, switch = (2, 1), (1 + D, D), (1 + N, N), (1 + N, D)
    # rows verifying a chain of 1, the tree's graph missing: the chain of 1 runs until paid
    kinds = [c.choose([None], True, check(one), 1) for _ in range(1000)]
    rented = kinds.index(N)
    tok = c.expected_tokens()
    lost = 0.9e-3 * (1 - tok[0] / 0.9e-3 / (tok[-1] / 1.5e-3))
    assert abs(rented - CAPTURE_SECONDS / lost) <= 1 and set(kinds[:rented]) == {1} and c.rent.owed
    c.run = 0  # (the chain's probe, waiting for the tree's graph since, held off here)
    assert c.choose([None], True, check(one, tree), 1) == N and not c.rent.owed  # the tree's graph: paid
    c.run, c.probe_after = 0, PROBE_AFTER
    kinds = [c.choose([None], True, check(one, tree), N) for _ in range(2 * PROBE_AFTER)]
    assert set(kinds) == {N}  # rows verifying trees: the probe's step (drafting a chain there) has no graph
    c.run = PROBE_AFTER
    assert c.choose([None], True, check(one, tree, switch), N) == 1  # with it, the chain of 1 is probed
    c.run = c.probe_after - 1
    assert c.choose([None], True, GraphCheck(lambda s: False, graphed=False), N) == 1
    # a chain the better option: at the tree's width the switch step lacks its graph, so the tree is rented, and
    # at a chain's width (its own graphs there) the chain runs
    worse = _choice()
    worse.costs = costs
    _steps(worse, False, 4, 100)
    _steps(worse, True, 0, 100)
    assert worse.choose([None], True, check(four, tree), N) == N and worse.rent.owed
    assert worse.choose([None], True, check(four, tree), D) == D
    assert worse.choose([None], True, check(four, tree, switch), N) == D
    assert GraphCheck(lambda s: s == D).graph_runs(1 + D, D) and not GraphCheck(lambda s: True).graph_runs(9, D)


def test_counts_follow_the_recent_steps():
    """A kind's counts are halved past ``WINDOW`` rows: a tree that accepted everything for long and nothing since
    is judged mostly by the recent steps."""
    c = _choice()
    _steps(c, True, D, WINDOW)
    _steps(c, True, 0, 2 * WINDOW)
    assert c.counts[TREE].rows <= WINDOW and c.expected_tokens()[-1] < 1.5


def test_a_tree_of_depth_many_nodes_still_drafts_a_tree(dirs):
    """N = D: the tree verifies as many tokens as the chain, so nothing is measured and the fixed rule drafts the
    tree (its topk children a node) at few rows."""
    c = TreeChoice(SpeculativeConfig(draft_model="random", max_draft_len=3, topk=2, max_total_draft_tokens=3))
    assert c.options() is None and c.choose([None]) == 3 and c.tree
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


def test_without_costs_the_fixed_rule_holds_and_the_options_are_the_chains_and_the_tree():
    c = _choice()  # tree_max_batch_size None: costs measured where the engine has graphs, TREE_MAX_BATCH elsewhere
    assert [c.choose([None] * b) for b in (1, 8, 9)] == [N, N, D]
    fixed = _choice(tree_max_batch_size=2)
    assert [fixed.choose([None] * b) for b in (2, 3)] == [N, D]
    opts = c.options()
    assert list(opts) == [1, 2, 3, D, N] and opts[D] is None and opts[N] == measurement_tree(3, D, N)
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

    def random_option(requests, generation=False, captured=None, verifying=0):
        choose(requests, generation, captured, verifying)  # the policy's own bookkeeping runs too
        policy.option = rng.randrange(len(policy.drafts))  # a chain of 1, 2 or 3 drafts, or the tree
        chosen.append(policy.drafts[policy.option])
        return chosen[-1]

    policy.choose = random_option
    spec, chain_steps = runner.speculator, []
    chain_step = spec._chain_step
    spec._chain_step = lambda *a: chain_steps.append(1) or chain_step(*a)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == reference
    assert {1, 2, 3, 8} <= set(chosen)
    # a graph layout of chains alone runs the chain engine's verify and draft loop
    assert bool(chain_steps) == graphs
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

    def random_option(requests, generation=False, captured=None, verifying=0):
        choose(requests, generation, captured, verifying)
        policy.option = rng.randrange(len(policy.drafts))
        asked = []
        graphs.has = lambda kind: asked.append(kind) or has(kind)
        check = graph_check(graphs, captured.layout, spec.graph_switches)  # a fresh check: no memo
        check.runs(*policy.step_graph(policy._width(verifying), policy.option))
        graphs.has = has
        steps.append(asked[0] if generation and isinstance(captured.layout(), tuple) else None)
        return policy.drafts[policy.option]

    def launched(batch, draft_len=None):
        ran.clear()
        out = launch(batch, draft_len)
        steps[-1] = (steps[-1], list(ran))
        return out

    policy.choose, runner.launch = random_option, launched
    graphs.run = lambda key, *a, **kw: ran.append(key.kind) or run(key, *a, **kw)
    llm.generate(PROMPTS, GREEDY)
    pairs = [(asked, kinds[0]) for asked, kinds in steps if asked is not None]
    assert len(pairs) > 10 and all(asked == first for asked, first in pairs)
    ran = {(asked[0].q, asked[1], asked[2]) for asked, _ in pairs}
    n, d = policy.num_nodes, policy.draft_len
    assert (1 + n, d, 1) in ran  # the switch step: a tree's width, drafting a chain of D
    assert {(2, 1, 1), (3, 2, 1), (1 + n, -1, 3)} <= ran  # chains shorter than D, the tree


def test_the_engine_measures_every_chain_length_and_the_tree_per_batch_bucket(dirs, tmp_path):
    """The costs a graph engine measures at start (graph layouts, run without capture on the CPU): each option's
    step per bucket (chains of 1..D, the tree), the blocks they took back in the pool, saved to and reloaded from
    the cost file, and the engine's output still plain greedy's with the choice weighing them."""
    plain = LLM(str(dirs / "target"), device="cpu", dtype="float32")
    reference = [o.token_ids for o in plain.generate(PROMPTS, GREEDY)]
    f = tmp_path / "costs.json"
    llm = _tree_llm(dirs, max_num_seqs=4)
    eng = llm.engine
    assert eng.draft_policy.costs is None  # no graphs on the CPU: the fixed rule
    spec = eng.runner.speculator
    assert spec.cost_options(False) is None and list(spec.cost_options(True)) == [1, 2, 3, 8]
    from specserve.runner.cuda_graph import CudaGraphs

    eng.runner.graphs = CudaGraphs(8, eng.runner._staging_buffers(), capture=False)  # the graph steps' layouts
    eng.spec_config.step_cost_file = str(f)
    costs = load_or_measure_costs(eng, spec.cost_options(True))
    assert costs.buckets == [1, 2, 4] and costs.max_draft_len == 3 and f.is_file()
    assert eng.pool.num_free == eng.pool.num_usable
    assert load_or_measure_costs(eng, spec.cost_options(True)) == costs  # read back, not measured again
    eng.draft_policy.costs = costs
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == reference
    assert sum(eng.spec_stats.steps_by_draft_len) > 0


def test_a_step_runs_at_the_trees_width_where_any_row_verifies_a_tree(dirs):
    """A layout narrower than the tree's holds chains alone (its graph runs the causal mask and moves no KV): a row
    verifying a tree (its own parents, or the tree the step in flight drafts for it) takes the step to N."""
    from types import SimpleNamespace as NS

    spec = _tree_llm(dirs).engine.runner.speculator  # depth 3, 8 nodes

    def row(drafts, parents=None, after=None):
        return NS(num_drafts=drafts, after=after, request=NS(spec_parents=parents))

    assert spec._verify_width([row(2), row(3), row(0)]) == 3
    assert spec._verify_width([row(2), row(3, [0, 0, 1])]) == 8  # a tree of 3 nodes (one cut to the room)
    assert spec._verify_width([row(2), row(2, after=NS(next_drafts=8))]) == 8  # in flight: a tree
    assert spec._verify_width([row(2), row(3, after=NS(next_drafts=3))]) == 3
    assert spec._verify_width([row(2), row(0, after=NS(next_drafts=8))]) == 8  # the device may give it a tree
    assert spec._verify_width([row(1), row(0, after=NS(next_drafts=3))]) == 3  # or a chain of 3


def test_no_row_verifies_more_drafts_than_its_layout_holds(dirs):
    """Under the overlap scheduler a row continuing the step in flight gets its drafts on the device, up to what that
    step proposed, even where the host expects none (its room, were every draft accepted, is spent): the step's
    layout must be that wide (``_verify_width``), or the row's unverified drafts would count as rejected. Replies of
    many lengths, options chosen at random each step, greedy output still plain decoding's."""
    params = [SamplingParams(temperature=0, max_tokens=5 + 3 * i, ignore_eos=True) for i in range(len(PROMPTS))]
    plain = LLM(str(dirs / "target"), device="cpu", dtype="float32")
    reference = [o.token_ids for o in plain.generate(PROMPTS, params)]
    from specserve.runner.cuda_graph import CudaGraphs

    widths = []
    for seed in range(6):
        llm = _tree_llm(dirs, overlap_scheduler=True)
        runner, policy, rng = llm.engine.runner, llm.engine.draft_policy, random.Random(seed)
        runner.graphs = CudaGraphs(8, runner._staging_buffers(), capture=False)
        spec, choose = runner.speculator, policy.choose

        def random_option(requests, generation=False, captured=None, verifying=0):
            choose(requests, generation, captured, verifying)
            policy.option = rng.randrange(len(policy.drafts))
            return policy.drafts[policy.option]

        def checked_step(model, batch, hidden, aux, step=spec.step):
            widths.append((int(batch.spec.num_nodes.max()), batch.spec.verify_idx.shape[1] - 1))
            return step(model, batch, hidden, aux)

        policy.choose, spec.step = random_option, checked_step
        assert [o.token_ids for o in llm.generate(PROMPTS, params)] == reference
    assert widths and all(most <= room for most, room in widths), [w for w in widths if w[0] > w[1]]
