"""The overlap scheduler: step n + 1 is scheduled and launched before step n's result reaches the host; its rows
that continue step n are staged as if every draft were accepted and corrected on the device. Outputs, finish
reasons and speculation statistics equal the synchronous engine's, token for token (float32, CPU, graph layouts
run without capture), for every head kind, batch sizes 1 / 3 / 8, chunked prefill, preemption, stop strings,
seeded sampling and aborts."""

from __future__ import annotations

import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.config import EngineArgs
from specserve.core.metrics import SpecStats
from specserve.runner.cuda_graph import CudaGraphs
from specserve.speculative.heads import DraftHead, DraftInputs
from tiny_models import PROMPTS, abort_while_running, make_head, make_hf_model, make_target_and_eagle3


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("overlap")
    make_target_and_eagle3(root)
    make_head(root / "mtp1", root / "target", "mtp", num_modules=1, seed=2)
    make_head(root / "mtp2", root / "target", "mtp", num_modules=2, seed=3)
    return root


SPECS = {
    "no-spec": None,
    "eagle3-d3": dict(method="eagle3", draft_model="eagle3", max_draft_len=3),
    "mtp_eagle-d2": dict(method="mtp", draft_model="mtp1", max_draft_len=2),
    "mtp_vanilla-d2": dict(method="mtp", draft_model="mtp2", max_draft_len=2, mtp_eagle=False),
    "eagle3-tree-k2-d3-n6": dict(method="eagle3", draft_model="eagle3", max_draft_len=3, topk=2,
                                 max_total_draft_tokens=6),
    "mtp_eagle-tree-k3-d2-n7": dict(method="mtp", draft_model="mtp1", max_draft_len=2, topk=3,
                                    max_total_draft_tokens=7),
    # steps of more than two rows draft chains through the tree's code: rows switch between layouts
    "eagle3-tree-chains-past-2": dict(method="eagle3", draft_model="eagle3", max_draft_len=3, topk=2,
                                      max_total_draft_tokens=6, tree_max_batch_size=2),
}


def _llm(dirs, spec: str | None, overlap: bool, graph_rows: int = 8, **kw) -> LLM:
    sc = None if SPECS[spec] is None else dict(SPECS[spec], draft_model=str(dirs / SPECS[spec]["draft_model"]))
    llm = LLM(str(dirs / "target"), device="cpu", dtype="float32", speculative_config=sc, async_output=True,
              overlap_scheduler=overlap, **kw)
    runner = llm.engine.runner
    runner.graphs = CudaGraphs(graph_rows, runner._staging_buffers(), capture=False)  # the CUDA path's layouts
    launch = runner.launch
    runner.continued = 0  # rows launched while the step they continue was still in flight

    def counting(batch):
        runner.continued += sum(s.after is not None for s in batch.scheduled)
        return launch(batch)

    runner.launch = counting
    if runner.speculator is not None:  # what the device verified, by row, to check against the host's rows
        runner.device_rows = []
        step = runner.speculator.step

        def recording(model, batch, hidden, aux):
            sp = batch.spec
            drafts = sp.num_drafts if hasattr(sp, "num_drafts") else sp.num_nodes  # a chain's, a tree's
            runner.device_rows += zip(sp.host_rows, sp.start.tolist(), drafts.tolist())
            return step(model, batch, hidden, aux)

        runner.speculator.step = recording
    return llm


def _assert_device_rows_match_host(llm: LLM) -> None:
    """Every row the device ran (after its correction) started and verified as the host has it once rebased."""
    rows = [(s, start, nd) for s, start, nd in llm.engine.runner.device_rows if not s.discard]
    assert rows and all(s.after is None and (s.start, s.num_drafts) == (start, nd) for s, start, nd in rows)


def _params(stop: str) -> list[SamplingParams]:
    return [SamplingParams(temperature=0, max_tokens=21, ignore_eos=True),
            SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=17, ignore_eos=True),
            SamplingParams(temperature=0, max_tokens=30, stop=[stop], ignore_eos=True),
            SamplingParams(temperature=0.8, top_k=20, seed=3, max_tokens=5)]


def _outputs(outs, stats: bool = True) -> list:
    return [(o.token_ids, o.text, o.finish_reason, o.outputs[0].stop_reason,
             None if o.spec is None or not stats else o.spec.as_dict()) for o in outs]


def _acceptance(stats: SpecStats) -> dict:
    """The engine's acceptance counts, without its steps by draft length (a count of engine steps, which a
    schedule that overlaps chunked prompts with other rows may cut differently)."""
    return {k: v for k, v in stats.as_dict().items() if k not in ("steps_by_draft_len", "draft_len_history")}


def _compare(dirs, spec, n, long: bool = False, **kw):
    sync = _llm(dirs, spec, False, **kw)
    every = [" ".join([p] * (4 if long else 1)) for p in PROMPTS * 2]
    probe = sync.generate(every[2], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0].text
    stop = probe[8:11]  # completed by a token in the middle of a step (several tokens a step with speculation)
    prompts = every[:n]
    params = [_params(stop)[i % 4] for i in range(n)]
    sync.engine.spec_stats = SpecStats()  # the probe's steps not counted
    ref = sync.generate(prompts, params)
    llm = _llm(dirs, spec, True, **kw)
    got = llm.generate(prompts, params)
    # which rows a preemption recomputes depends on the schedule, and with them the drafts a row verifies after;
    # so does a step's choice of tree or chain (its rows)
    exact = "num_kv_blocks" not in kw and "tree_max_batch_size" not in (SPECS[spec] or {})
    assert _outputs(got, exact) == _outputs(ref, exact)
    if spec != "no-spec" and exact:  # each verified draft once (the engine's steps may be cut otherwise: chunks)
        assert _acceptance(llm.engine.spec_stats) == _acceptance(sync.engine.spec_stats)
    assert llm.engine.runner.continued > 0
    if spec != "no-spec":
        _assert_device_rows_match_host(llm)
    pool = llm.engine.pool
    assert pool.num_free == pool.num_usable and llm.engine._in_flight is None
    return got


@pytest.mark.parametrize("spec", list(SPECS))
@pytest.mark.parametrize("kw", [{}, dict(max_num_batched_tokens=40, long=True), dict(block_size=4, num_kv_blocks=40)],
                         ids=["plain", "chunked", "preempting"])
def test_overlap_equals_synchronous_steps(dirs, spec, kw):
    """Chunked: prompts of 40-odd tokens arrive in chunks of a 40-token budget beside running rows."""
    got = _compare(dirs, spec, 8, **kw)
    assert any(o.finish_reason == "stop" for o in got)
    if "num_kv_blocks" in kw:
        assert sum(o.metrics.num_preemptions for o in got) > 0


@pytest.mark.parametrize("spec", list(SPECS))
@pytest.mark.parametrize("n", [1, 3])
def test_overlap_equals_synchronous_steps_at_small_batches(dirs, spec, n):
    _compare(dirs, spec, n)


@pytest.mark.parametrize("spec", ["no-spec", "eagle3-d3", "mtp_eagle-d2", "eagle3-tree-k2-d3-n6"])
def test_a_budget_that_cuts_drafts_keeps_greedy_outputs(dirs, spec):
    """A 7-token budget cuts rows' drafts. Which rows it cuts depends on the schedule, and the overlap scheduler's
    differs (it schedules a request that the running step is about to end), so draft counts may differ; greedy
    tokens do not, every verified draft is counted once, and the host's rows verify what the device's did."""
    params = [SamplingParams(temperature=0, max_tokens=10 + 2 * i, ignore_eos=True) for i in range(8)]
    ref = _llm(dirs, spec, False, max_num_batched_tokens=7).generate(PROMPTS, params)
    llm = _llm(dirs, spec, True, max_num_batched_tokens=7)
    got = llm.generate(PROMPTS, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    if spec != "no-spec":
        _assert_device_rows_match_host(llm)  # a row whose drafts the budget cut verifies as few once rebased
        total = llm.engine.spec_stats
        assert total.num_emitted == sum(o.spec.num_emitted for o in got) > 0
        assert total.num_drafted == sum(o.spec.num_drafted for o in got)
        assert total.num_accepted == sum(o.spec.num_accepted for o in got)


def test_more_rows_than_graphs_fall_back_to_collecting_first(dirs):
    """Eight running requests and graphs of at most four rows: the step cannot correct its rows on the device, so
    the engine collects the running step before scheduling; outputs are unchanged, overlap resumes as rows end."""
    params = [SamplingParams(temperature=0, max_tokens=4 + 3 * i, ignore_eos=True) for i in range(8)]
    ref = _llm(dirs, "eagle3-d3", False).generate(PROMPTS, params)
    llm = _llm(dirs, "eagle3-d3", True, graph_rows=4)
    assert _outputs(llm.generate(PROMPTS, params)) == _outputs(ref)
    assert llm.engine.runner.continued > 0


class OracleHead(DraftHead):
    """Drafts the target's greedy continuation, correct for the first ``right`` drafts and wrong after: every step
    accepts exactly ``right`` drafts (fewer where the request ends)."""

    num_kv_layers = 0

    def __init__(self, refs: dict, vocab: int, right: int) -> None:
        super().__init__()
        self.refs, self.vocab, self.right = refs, vocab, right

    def propose(self, x: DraftInputs, kv: list, out=None) -> torch.Tensor:
        rows = []
        for i, pos in enumerate(x.last_pos.tolist()):  # padding rows past the scheduled ones draft zeros
            if i >= len(x.host_rows):
                rows.append([0] * x.draft_len)
                continue
            req = x.host_rows[i].request
            full = self.refs[tuple(req.prompt_token_ids)]
            d = list(full[pos + 2:pos + 2 + x.draft_len])
            d += [0] * (x.draft_len - len(d))
            d[self.right:] = [(t + 1) % self.vocab for t in d[self.right:]]
            rows.append(d)
        return torch.tensor(rows, dtype=torch.int64)


@pytest.mark.parametrize("right", [0, 1, 2, 3])
def test_partial_acceptance_is_corrected_on_the_device(dirs, right):
    """A head whose first ``right`` drafts are right: every step starts ``3 - right`` positions before the
    place its row was staged at; outputs and counts equal the synchronous engine's."""
    greedy = SamplingParams(temperature=0, max_tokens=19, ignore_eos=True)
    plain = _llm(dirs, "no-spec", False)
    ref = [o.token_ids for o in plain.generate(PROMPTS[:3], greedy)]
    refs = {tuple(plain.tokenizer.encode(p)): plain.tokenizer.encode(p) + r for p, r in zip(PROMPTS, ref)}
    stats = []
    for overlap in (False, True):
        llm = _llm(dirs, "eagle3-d3", overlap)
        head = OracleHead(refs, llm.engine.model_config.vocab_size, right).bind(llm.engine.model)
        llm.engine.runner.speculator.drafter.head = head
        assert [o.token_ids for o in llm.generate(PROMPTS[:3], greedy)] == ref
        stats.append(llm.engine.spec_stats.as_dict())
        _assert_device_rows_match_host(llm)
    assert stats[0] == stats[1]
    assert stats[1]["accepted"] == pytest.approx(min(right, 3) * stats[1]["verify_steps"], abs=9)


@pytest.mark.parametrize("spec", ["no-spec", "eagle3-d3"])
def test_aborting_a_request_with_rows_in_two_steps(dirs, spec):
    """Aborted while one step runs and the next is scheduled after it: neither step's rows for it are
    reported, its blocks return to the pool, and the request beside it finishes as it would alone."""
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    alone = _llm(dirs, spec, False).generate(PROMPTS[0], params)[0].token_ids
    eng = _llm(dirs, spec, True).engine
    gone, seen, final = abort_while_running(eng, params, 4)
    assert eng.runner.continued > 0  # the step after the one in flight was launched before it was collected
    assert gone not in seen and final.request_id != gone and final.token_ids == alone
    assert eng.pool.num_free == eng.pool.num_usable


@pytest.mark.parametrize("spec", ["no-spec", "eagle3-d3"])
def test_a_request_ending_on_a_stop_token_drops_its_next_row(dirs, spec):
    """The token that ends a request arrives with the step after it already launched: that row is dropped
    (nothing past the end is reported) and the request's output equals the synchronous engine's."""
    sync = _llm(dirs, spec, False)
    free = sync.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].token_ids
    params = SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[free[6]], ignore_eos=True)
    ref = sync.generate(PROMPTS[1], params)[0]
    llm = _llm(dirs, spec, True)
    eng = llm.engine
    dropped = []
    update = eng.scheduler.update
    eng.scheduler.update = lambda out, results: (dropped.extend(s for s in out.scheduled if s.discard)
                                                 or update(out, results))
    got = llm.generate(PROMPTS[1], params)[0]
    assert got.token_ids == ref.token_ids == free[:free.index(free[6]) + 1] and got.finish_reason == "stop"
    assert dropped  # the row launched after the stop token's step
    assert eng.pool.num_free == eng.pool.num_usable


def test_overlap_is_on_by_default_on_cuda_only():
    cfg = EngineArgs(device="cpu").create_engine_config()
    assert cfg.overlap_scheduler is False
    assert EngineArgs(device="cpu", overlap_scheduler=True).create_engine_config().overlap_scheduler is True
    with pytest.raises(ValueError, match="overlap_scheduler"):
        EngineArgs(device="cpu", overlap_scheduler="yes").create_engine_config()


def test_the_thinking_phase_follows_tokens_the_host_has_not_seen(tmp_path):
    """Relaxed acceptance in a thinking phase opened and closed by tokens 4 and 5 of an 8-token vocabulary (both
    emitted often): a row's phase is corrected on the device from the tokens the step before emitted, so the
    relaxed acceptances, and with them the tokens, equal the synchronous engine's."""
    make_hf_model(tmp_path / "t", "llama", vocab_size=8, initializer_range=0.3, num_hidden_layers=2)
    make_head(tmp_path / "h", tmp_path / "t", "mtp", num_modules=1, seed=5)
    cfg = dict(method="mtp", draft_model=str(tmp_path / "h"), max_draft_len=3,
               use_relaxed_acceptance_for_thinking=True, relaxed_topk=3, relaxed_delta=0.3,
               begin_thinking_phase_token=4, end_thinking_phase_token=5)
    prompts = [{"prompt_token_ids": p} for p in ([3, 4, 1, 6, 2, 7, 1, 1, 2], [4, 5, 6, 6, 1, 3, 2], [1, 2, 3, 4])]
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    outs, stats = [], []
    for overlap in (False, True):
        llm = LLM(str(tmp_path / "t"), device="cpu", dtype="float32", num_kv_blocks=64, speculative_config=cfg,
                  async_output=True, overlap_scheduler=overlap)
        llm.engine.runner.graphs = CudaGraphs(4, llm.engine.runner._staging_buffers(), capture=False)
        outs.append([o.token_ids for o in llm.generate(prompts, sp)])
        stats.append(llm.engine.spec_stats.as_dict())
    assert outs[0] == outs[1] and stats[0] == stats[1]
    emitted = [t for o in outs[1] for t in o]
    assert emitted.count(4) > 3 and emitted.count(5) > 3  # the phase opens and closes inside the outputs


def test_an_oracle_tree_under_overlap(dirs):
    """A tree whose path hides behind a wrong sibling at every depth (tests/test_tree.py's oracle): each step
    accepts its full depth at columns 2, 4, 6, so the next step's rows move back by N - D = 3 on the device; outputs
    and counts equal the synchronous engine's."""
    from test_tree import _oracle

    greedy = SamplingParams(temperature=0, max_tokens=19, ignore_eos=True)
    ref = [o.token_ids for o in _llm(dirs, "no-spec", False).generate(PROMPTS, greedy)]
    stats = []
    for overlap in (False, True):
        llm = _llm(dirs, "eagle3-tree-k2-d3-n6", overlap)
        _oracle(llm, ref, 3)
        assert [o.token_ids for o in llm.generate(PROMPTS, greedy)] == ref
        stats.append(llm.engine.spec_stats.as_dict())
        _assert_device_rows_match_host(llm)
    assert stats[0] == stats[1] and stats[1]["per_position_acceptance"] == [1.0] * 3
    assert llm.engine.runner.continued > 0
