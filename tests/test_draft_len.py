"""The draft length chosen per step (``speculative/draft_len.py``): greedy output equals plain decoding while D
changes between steps (0 included, every head kind, graph and packed layouts, the overlap scheduler, chunked
prefill, preemption); seeded sampling keeps the target's distribution (chi-square); the adaptive engine's step
costs measured, saved and reloaded, and its choices in the engine; the settings and CLI flags
(``test_draft_len_policy.py``: the policies themselves on synthetic costs and acceptance)."""

from __future__ import annotations

import json
import random
from collections import Counter

import pytest

from specserve import LLM, SamplingParams, SpeculativeConfig
from specserve.speculative.step_costs import StepCosts
from accept_helpers import chi2_critical, chi2_homogeneity, make_small_vocab, sample_replies
from test_overlap import OracleHead, _llm
from tiny_models import PROMPTS, make_head, make_target_and_eagle3

GREEDY = SamplingParams(temperature=0, max_tokens=19, ignore_eos=True)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("draft_len")
    make_target_and_eagle3(root)
    make_head(root / "mtp1", root / "target", "mtp", num_modules=1, seed=2)
    make_head(root / "mtp3", root / "target", "mtp", num_modules=3, seed=3)
    return root


# a schedule that never binds makes the draft length vary (each step's layout as wide as its drafts); the tests
# then choose D at random per step
VARIES = dict(draft_len_schedule={64: 3})
SPECS = {
    "eagle3-oracle": dict(method="eagle3", draft_model="eagle3", max_draft_len=3, **VARIES),
    "mtp_eagle": dict(method="mtp", draft_model="mtp1", max_draft_len=3, **VARIES),
    # module k reads the tokens k + 1 ahead: drafting 3 after verifying none reads past the step's columns
    "mtp_vanilla": dict(method="mtp", draft_model="mtp3", max_draft_len=3, mtp_eagle=False, **VARIES),
}


@pytest.fixture(scope="module")
def reference(dirs):
    llm = LLM(str(dirs / "target"), device="cpu", dtype="float32")
    prompts = PROMPTS * 2
    outs = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    refs = {tuple(llm.tokenizer.encode(p)): llm.tokenizer.encode(p) + o for p, o in zip(prompts, outs)}
    return prompts, outs, refs


def _random_lengths(llm: LLM, seed: int) -> list[int]:
    """Each step drafts a D in 0..max_draft_len: a cycle through every value with jumps both ways (0 to the
    most, the most to 0), then random -> the choices, in order."""
    rng, chosen = random.Random(seed), []
    policy = llm.engine.draft_policy
    d = policy.max_draft_len
    first = [0, d, 1, d, 0, 0, d, d, 2 % (d + 1)]

    def choose(requests, generation=False, captured=None, verifying=0):
        chosen.append(first[len(chosen)] if len(chosen) < len(first) else rng.randint(0, d))
        return chosen[-1]

    policy.choose = choose
    return chosen


@pytest.mark.parametrize("spec", list(SPECS))
@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
@pytest.mark.parametrize("kw", [{}, dict(max_num_batched_tokens=12), dict(block_size=4, num_kv_blocks=40)],
                         ids=["plain", "chunked", "preempting"])
def test_greedy_output_is_plain_while_the_draft_length_changes(dirs, reference, spec, overlap, kw):
    prompts, ref, refs = reference
    sc = dict(SPECS[spec], draft_model=str(dirs / SPECS[spec]["draft_model"]))
    # graph layouts (run without capture on the CPU) with the overlap scheduler; packed steps without it
    llm = LLM(str(dirs / "target"), device="cpu", dtype="float32", speculative_config=sc, overlap_scheduler=overlap,
              **kw)
    keys = []
    if overlap:
        from specserve.runner.cuda_graph import CudaGraphs

        runner = llm.engine.runner
        runner.graphs = graphs = CudaGraphs(16, runner._staging_buffers(), capture=False)  # every batch size
        run = graphs.run
        graphs.run = lambda key, *a, **k: keys.append(key) or run(key, *a, **k)
    if spec == "eagle3-oracle":  # drafts that are right twice, then wrong: acceptance that D cuts
        head = OracleHead(refs, llm.engine.model_config.vocab_size, 2).bind(llm.engine.model)
        llm.engine.runner.speculator.drafter.head = head
    chosen = _random_lengths(llm, seed=len(spec) + overlap)
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == ref
    stats = llm.engine.spec_stats
    assert set(chosen) == {0, 1, 2, 3}
    # a generation graph verifies as many drafts as it drafts: one graph per D (D + 1 of them, not (D + 1)^2); steps
    # that verify and draft nothing run as plain steps (switches.draft_len -1)
    gen = {(layout.rows, layout.q - 1, switches.draft_len) for layout, switches, _ in keys if not layout.prefill}
    assert all(v == max(d, 0) for _, v, d in gen) and len({d for _, _, d in gen}) > 1 if overlap else not keys
    assert sum(stats.steps_by_draft_len) == sum(n for _, n in stats.draft_len_history) > 0
    if spec == "eagle3-oracle":
        # right twice (but where the reply ends within two drafts): the third is never accepted
        assert stats.per_position[0] == 1.0 and stats.per_position[1] > 0.9 and stats.per_position[2] == 0.0
    assert llm.engine.pool.num_free == llm.engine.pool.num_usable


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_steps_that_verify_and_draft_nothing_run_as_plain_steps(dirs, reference, overlap):
    """Runs of D = 0 between drafting steps: a step that proposes none and verifies none (nor continues a row whose
    step verifies some) runs as a plain step (no speculator: the plain graph, switches.draft_len -1), and the steps
    after it, plain or drafting, read its tokens; greedy output stays that of plain decoding."""
    prompts, ref, refs = reference
    sc = dict(SPECS["eagle3-oracle"], draft_model=str(dirs / "eagle3"))
    llm = LLM(str(dirs / "target"), device="cpu", dtype="float32", speculative_config=sc, overlap_scheduler=overlap)
    runner = llm.engine.runner
    keys, kinds = [], []
    if overlap:
        from specserve.runner.cuda_graph import CudaGraphs

        runner.graphs = graphs = CudaGraphs(16, runner._staging_buffers(), capture=False)
        run = graphs.run
        graphs.run = lambda key, *a, **k: keys.append(key) or run(key, *a, **k)
    head = OracleHead(refs, llm.engine.model_config.vocab_size, 2).bind(llm.engine.model)
    runner.speculator.drafter.head = head
    pattern = [0, 0, 0, 0, 0, 3, 3, 0, 0, 0, 2, 0, 0, 0, 0, 1]
    steps = []
    runner.speculator.policy.choose = lambda *a, **k: pattern[len(steps) % len(pattern)]
    launch = runner.launch

    def counting(batch, draft_len=None):
        steps.append(batch)
        out = launch(batch, draft_len)
        kinds.append((out.spec is None, any(s.after is not None for s in batch.scheduled)))
        return out

    runner.launch = counting
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == ref
    assert any(plain for plain, _ in kinds) and not all(plain for plain, _ in kinds)
    # under the overlap scheduler plain steps continue rows of the step in flight (plain and drafting alike)
    assert any(plain and after for plain, after in kinds) == overlap
    stats = llm.engine.spec_stats
    assert stats.num_accepted > 0 and stats.steps_by_draft_len[0] > stats.steps_by_draft_len[3]
    if overlap:
        gen = {(layout.q - 1, switches.draft_len) for layout, switches, _ in keys if not layout.prefill}
        assert {(0, -1), (3, 3), (2, 2), (1, 1)} <= gen, gen
    assert llm.engine.pool.num_free == llm.engine.pool.num_usable


def test_the_overlap_scheduler_verifies_what_each_step_drafted(dirs, reference):
    """Under the overlap scheduler a row is staged before the step it continues is collected: it verifies the
    drafts that step proposed (its own D), which the host's rows, once rebased, agree with."""
    from test_overlap import _assert_device_rows_match_host

    prompts, ref, refs = reference
    llm = _llm(dirs, "eagle3-d3", True)
    head = OracleHead(refs, llm.engine.model_config.vocab_size, 3).bind(llm.engine.model)
    llm.engine.runner.speculator.drafter.head = head
    llm.engine.runner.speculator.policy.schedule = [(64, 3)]  # the draft length varies: layouts as wide as drafts
    _random_lengths(llm, seed=3)
    assert [o.token_ids for o in llm.generate(prompts[:5], GREEDY)] == ref[:5]
    _assert_device_rows_match_host(llm)
    assert llm.engine.runner.continued > 0


def test_sampled_acceptance_keeps_the_distribution_while_the_draft_length_changes(tmp_path_factory):
    """Tokens 2 and 3 of 3-token replies under plain sampling and speculation whose D is random per step: one
    distribution (chi-square)."""
    root = make_small_vocab(tmp_path_factory.mktemp("draft_len_sampled"))
    n = 3000
    plain, _ = sample_replies(root, None, n, [1, 2, 3], seed=500)
    got, stats = sample_replies(root, dict(max_draft_len=2, draft_len_schedule={4096: 2}), n, [1, 2, 3], seed=500,
                                setup=lambda llm: _random_lengths(llm, seed=9))
    assert stats.num_accepted > 0.1 * n and len(stats.steps_by_draft_len) == 3  # enough accepted to bite
    a = Counter(tuple(o.token_ids[1:3]) for o in plain)
    b = Counter(tuple(o.token_ids[1:3]) for o in got)
    stat, dof = chi2_homogeneity(a, b)
    assert stat < chi2_critical(dof), (stat, dof)


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_adaptive_engine_measures_saves_and_reloads_its_costs(dirs, reference, tmp_path, monkeypatch, overlap):
    """An adaptive engine measures a step of each (batch bucket, D) at start (under the overlap scheduler each
    step launched before the one before is collected) and writes them to its cost file; the next engine reads
    them instead of measuring; outputs stay plain greedy's and the blocks the measurement took go back to the
    pool."""
    import specserve.speculative.step_costs as step_costs

    prompts, ref, refs = reference
    f = tmp_path / "costs.json"
    sc = dict(SPECS["eagle3-oracle"], draft_model=str(dirs / "eagle3"), adaptive_draft_len=True,
              step_cost_file=str(f))
    llm = LLM(str(dirs / "target"), device="cpu", dtype="float32", speculative_config=sc, max_num_seqs=4,
              overlap_scheduler=overlap)
    costs = llm.engine.draft_policy.costs
    assert costs.buckets == [1, 2, 4] and costs.max_draft_len == 3
    assert llm.engine.pool.num_free == llm.engine.pool.num_usable
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == ref
    saved = json.loads(f.read_text())
    assert len(saved) == 1 and next(iter(saved.values()))["buckets"] == [1, 2, 4]

    def no_measuring(*a, **k):
        raise AssertionError("measured again")

    monkeypatch.setattr(step_costs, "measure_step_costs", no_measuring)
    again = LLM(str(dirs / "target"), device="cpu", dtype="float32", speculative_config=sc, max_num_seqs=4)
    assert again.engine.draft_policy.costs == costs


def test_a_head_that_never_accepts_stops_drafting(dirs, reference):
    """With costs where drafting pays only if drafts are accepted, a head that never is right is soon given D = 0
    (its requests' own counts outweigh the prior); an oracle head keeps the longest D."""
    prompts, ref, refs = reference
    sc = dict(SPECS["eagle3-oracle"], draft_model=str(dirs / "eagle3"), adaptive_draft_len=True)
    for right, expect in ((0, 0), (3, 3)):
        llm = LLM(str(dirs / "target"), device="cpu", dtype="float32", speculative_config=sc, max_num_seqs=8)
        llm.engine.draft_policy.costs = StepCosts([8], [[1.0, 1.3, 1.6, 1.9]])
        llm.engine.draft_policy.timed = False  # the costs as given (observed periods would move them to this CPU's)
        head = OracleHead(refs, llm.engine.model_config.vocab_size, right).bind(llm.engine.model)
        llm.engine.runner.speculator.drafter.head = head
        assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == ref
        last = llm.engine.spec_stats.draft_len_history[-1]
        assert last[0] == expect, llm.engine.spec_stats.draft_len_history


def test_the_policy_keeps_its_acceptance_counts_when_the_reported_ones_are_reset(dirs, reference):
    """``bench`` resets the engine's reported counts before each timed run: the draft length's choice counts the
    engine's acceptance itself, so an engine that learnt its head accepts nothing starts the next run at D = 0
    instead of drafting again from the optimistic prior."""
    from specserve.core.metrics import SpecStats

    prompts, ref, refs = reference
    sc = dict(SPECS["eagle3-oracle"], draft_model=str(dirs / "eagle3"), adaptive_draft_len=True)
    llm = LLM(str(dirs / "target"), device="cpu", dtype="float32", speculative_config=sc, max_num_seqs=8)
    policy = llm.engine.draft_policy
    policy.costs = StepCosts([8], [[1.0, 1.3, 1.6, 1.9]])
    policy.timed = False  # the costs as given
    llm.engine.runner.speculator.drafter.head = OracleHead(refs, llm.engine.model_config.vocab_size, 0).bind(
        llm.engine.model)
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == ref
    first = llm.engine.spec_stats
    assert first.num_drafted > 0 and first.num_accepted == 0
    assert (policy.counts.num_drafted, policy.counts.num_accepted) == (first.num_drafted, 0)
    llm.engine.spec_stats = SpecStats()
    policy.probe_after = 10 ** 6  # no probe in the second run (a choice of D > 0 resets the wait)
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == ref
    # no step of the second run proposes drafts
    assert llm.engine.spec_stats.steps_by_draft_len[1:] in ([], [0] * 3), llm.engine.spec_stats.draft_len_history
    assert policy.counts.num_drafted == first.num_drafted


def test_the_engine_keeps_to_draft_lengths_whose_graphs_exist(dirs, reference, monkeypatch):
    """The runner tells the policy which D have their step's graph (without capture, as here and under
    enforce_eager, the layouts run: the same choices as with capture): with a capture made to cost more than any
    gain, every step where some D has one takes such a D; greedy outputs are plain's."""
    import specserve.speculative.draft_len as draft_len
    from specserve.runner.cuda_graph import CudaGraphs

    prompts, ref, refs = reference
    monkeypatch.setattr(draft_len, "CAPTURE_SECONDS", 1e9)
    sc = dict(SPECS["eagle3-oracle"], draft_model=str(dirs / "eagle3"), adaptive_draft_len=True)
    llm = LLM(str(dirs / "target"), device="cpu", dtype="float32", speculative_config=sc, max_num_seqs=8)
    runner = llm.engine.runner
    runner.graphs = CudaGraphs(8, runner._staging_buffers(), capture=False)  # has(): the layouts run
    policy = llm.engine.draft_policy
    policy.costs = StepCosts([8], [[1.0, 1.1, 1.2, 1.3]])  # the oracle's 2 right drafts: D = 2 the best
    policy.timed = False  # the estimates stay as set (no periods observed)
    llm.engine.runner.speculator.drafter.head = OracleHead(refs, llm.engine.model_config.vocab_size, 2).bind(
        llm.engine.model)
    calls, choose = [], policy.choose

    def spy(requests, generation=False, captured=None, verifying=0):
        if len(calls) == 6:  # now D = 1 is the best by far, but its steps' layouts have no graphs
            policy.live = StepCosts([8], [[1.0, 1.0, 5.0, 5.0]])
        d = choose(requests, generation, captured, verifying)
        if captured is not None:
            calls.append((d, [captured.has(k) for k in range(policy.max_draft_len + 1)]))
        return d

    policy.choose = spy
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == ref
    assert len(calls) > 10 and all(have[d] for d, have in calls if any(have))
    # steps where the best, D = 1, had no graph and another D had one (which they took)
    assert any(not have[1] and any(have) for _, have in calls[7:])
    # their losses are counted by what the step's graphs share (a generation step's padded rows and table width, a
    # prompt step's prefill layout), which the runner names
    owed = policy.rent.owed
    assert owed and all(isinstance(k[0], tuple) and len(k[0]) == 2 or k[0].prefill for k in owed)


def test_a_launch_reads_its_rows_table_width_once(dirs, reference):
    """The draft length's graph check and the step's graph layout both need a generation step's table width (two
    passes over every row): inside one launch it is computed once, and afresh for the next launch's rows."""
    from specserve.runner.cuda_graph import CudaGraphs

    prompts, ref, refs = reference
    sc = dict(SPECS["eagle3-oracle"], draft_model=str(dirs / "eagle3"), adaptive_draft_len=True)
    llm = LLM(str(dirs / "target"), device="cpu", dtype="float32", speculative_config=sc, max_num_seqs=8)
    runner = llm.engine.runner
    runner.graphs = CudaGraphs(8, runner._staging_buffers(), capture=False)
    llm.engine.draft_policy.costs = StepCosts([8], [[1.0, 1.1, 1.2, 1.3]])
    widths, table_width, launches, launch = [], runner._table_width, [], runner.launch
    runner._table_width = lambda sched: widths.append(len(sched)) or table_width(sched)

    def counted(batch, draft_len=None):
        gen, before = all(map(runner._generation_row, batch.scheduled)), len(widths)
        out = launch(batch, draft_len)
        launches.append((gen, len(widths) - before))
        return out

    runner.launch = counted
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == ref
    gen = [n for g, n in launches if g]
    assert len(gen) > 10 and set(gen) == {1}


def test_a_prompt_step_keeps_to_a_draft_length_whose_prefill_graph_exists(dirs, reference, monkeypatch):
    """A prompt step's graph (a prefill layout) is captured per D too (D is its switch): once the best D changes, a
    prompt step whose layout has a graph for another D takes that D rather than capture one mid-run (emulated
    graphs, one row at a time, a capture made to cost more than any gain); greedy outputs are plain's."""
    import specserve.speculative.draft_len as draft_len
    from specserve.runner.cuda_graph import CudaGraphs
    from specserve.runner.graph_layout import GraphLayout

    prompts, ref, refs = reference
    monkeypatch.setattr(draft_len, "CAPTURE_SECONDS", 1e9)
    sc = dict(SPECS["eagle3-oracle"], draft_model=str(dirs / "eagle3"), adaptive_draft_len=True)
    llm = LLM(str(dirs / "target"), device="cpu", dtype="float32", speculative_config=sc, max_num_seqs=1)
    runner = llm.engine.runner
    runner.graphs = CudaGraphs(1, runner._staging_buffers(), capture=False)
    policy = llm.engine.draft_policy
    policy.costs = StepCosts([1], [[1.0, 1.1, 1.2, 1.3]])  # the oracle's 2 right drafts: D = 2 the best
    policy.timed = False
    llm.engine.runner.speculator.drafter.head = OracleHead(refs, llm.engine.model_config.vocab_size, 2).bind(
        llm.engine.model)
    first = prompts[:3]
    assert [o.token_ids for o in llm.generate(first, GREEDY)] == ref[:3]
    policy.live = StepCosts([1], [[1.0, 1.0, 5.0, 5.0]])  # now D = 1 is the best by far
    prompt_steps, choose = [], policy.choose

    def spy(requests, generation=False, captured=None, verifying=0):
        d = choose(requests, generation, captured, verifying)
        lay = captured.layout() if captured is not None else None
        if isinstance(lay, GraphLayout) and lay.prefill:
            prompt_steps.append((d, [captured.has(k) for k in range(policy.max_draft_len + 1)]))
        return d

    policy.choose = spy
    assert [o.token_ids for o in llm.generate(first, GREEDY)] == ref[:3]
    # the same prompts' layouts have their graphs of the first run's D (where the staging buffers have not moved
    # since), none of D = 1: such a prompt step takes a D with its graph
    assert len(prompt_steps) == 3 and all(have[d] for d, have in prompt_steps if any(have)), prompt_steps
    assert sum(any(have) and not have[1] for _, have in prompt_steps) >= 2, prompt_steps


def test_a_head_that_never_accepts_reaches_steps_of_d0_through_the_graphs_they_need(dirs, reference, monkeypatch):
    """Under graphs (emulated: the layouts run) a head that never accepts rents the D that has its graph while D = 0
    has none, then takes D = 0 and keeps it: the step after the choice still verifies the last drafts (as wide as
    them), and the one after captures D = 0's graph. Weighing each choice by the graph of the step it makes (as wide
    as the drafts it verifies) instead chose 0 only for steps that ran wide and never ran one of D = 0."""
    import specserve.speculative.draft_len as draft_len
    from specserve.runner.cuda_graph import CudaGraphs

    prompts, ref, refs = reference
    monkeypatch.setattr(draft_len, "CAPTURE_SECONDS", 1.5)  # two steps' rent, in the synthetic costs' seconds
    sc = dict(SPECS["eagle3-oracle"], draft_model=str(dirs / "eagle3"), adaptive_draft_len=True)
    llm = LLM(str(dirs / "target"), device="cpu", dtype="float32", speculative_config=sc, max_num_seqs=8)
    runner = llm.engine.runner
    runner.graphs = CudaGraphs(8, runner._staging_buffers(), capture=False)
    policy = llm.engine.draft_policy
    policy.costs = StepCosts([8], [[1.0, 1.3, 1.6, 1.9]])
    policy.timed = False
    spec = runner.speculator
    spec.drafter.head = OracleHead(refs, llm.engine.model_config.vocab_size, 0).bind(llm.engine.model)
    ran, plan = [], spec.plan_step

    def spy(sched, draft_len=None, captured=None):
        d = plan(sched, draft_len, captured)
        if spec.generation_step(sched):
            ran.append(spec.step_draft_len)
        return d

    monkeypatch.setattr(spec, "plan_step", spy)
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == ref
    # the first 8 rows run together for 19 steps (nothing is accepted): two rent steps, the step that verifies the
    # last drafts, then D = 0 in their own layout (not only once rows finish and layouts without graphs come)
    assert 0 in ran[:8] and ran.count(0) > len(ran) // 2, ran


def test_draft_length_settings_are_checked():
    ok = SpeculativeConfig(draft_model="random", max_draft_len=4, draft_len_schedule={"4": 4, "8": 2})
    assert ok.draft_len_schedule == {4: 4, 8: 2} and ok.varies_draft_len
    assert not SpeculativeConfig(draft_model="random").varies_draft_len
    for bad, match in ((dict(draft_len_schedule={4: 5}), "draft lengths"), (dict(draft_len_schedule={}), "non-empty"),
                       (dict(draft_len_schedule={"x": 1}), "integer"), (dict(draft_len_schedule={0: 1}), ">= 1"),
                       (dict(acceptance_rate_window_size=8), "both"),
                       (dict(acceptance_rate_window_size=0, acceptance_rate_threshold=0.5), ">= 1"),
                       (dict(acceptance_rate_window_size=8, acceptance_rate_threshold=1.5), r"\[0, 1\]"),
                       (dict(step_cost_file="c.json"), "adaptive_draft_len=True"),
                       (dict(topk=2, adaptive_draft_len=True), "chains")):
        with pytest.raises(ValueError, match=match):
            SpeculativeConfig(draft_model="random", max_draft_len=4, **bad)


def test_cli_flags_reach_the_speculative_config(dirs):
    from specserve.cli import build_parser, engine_args

    a = build_parser().parse_args(["generate", "x", "--model", str(dirs / "target"), "--draft", str(dirs / "eagle3"),
                                   "--draft-len-schedule", "4:4,8:2,32:1", "--acceptance-rate-window-size", "16",
                                   "--acceptance-rate-threshold", "0.3", "--adaptive-draft-len",
                                   "--step-cost-file", "c.json"])
    spec = SpeculativeConfig.from_value(engine_args(a).speculative_config)
    assert (spec.draft_len_schedule, spec.acceptance_rate_window_size, spec.acceptance_rate_threshold,
            spec.adaptive_draft_len, spec.step_cost_file) == ({4: 4, 8: 2, 32: 1}, 16, 0.3, True, "c.json")
    a = build_parser().parse_args(["generate", "x", "--model", str(dirs / "target"), "--draft", str(dirs / "eagle3"),
                                   "--topk", "2", "--tree-max-batch-size", "16"])
    spec = SpeculativeConfig.from_value(engine_args(a).speculative_config)
    assert (spec.topk, spec.tree_max_batch_size, spec.measures_tree_costs) == (2, 16, False)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "x", "--draft-len-schedule", "4-4"])
    with pytest.raises(ValueError, match="--adaptive-draft-len set but speculation is off"):
        engine_args(build_parser().parse_args(["generate", "x", "--no-spec", "--adaptive-draft-len"]))
