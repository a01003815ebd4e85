"""``async_output``: a step's detokenizing and outputs run while the device runs the next step. Nothing is launched
before the tokens it depends on are known, so every output equals the synchronous engine's, with speculation on
and off, under chunked prefill, preemption, stop strings, sampling and aborts."""

from __future__ import annotations

import pytest

from specserve import LLM, SamplingParams
from tiny_models import PROMPTS, abort_while_running, target_with_eagle3


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return target_with_eagle3(tmp_path_factory.mktemp("async"))


SPECS = {"no-spec": None, "eagle3-d3": dict(method="eagle3", draft_model="eagle3", max_draft_len=3)}


def _llm(dirs, spec, async_output: bool, **kw) -> LLM:
    sc = None if SPECS[spec] is None else dict(SPECS[spec], draft_model=str(dirs / "eagle3"))
    return LLM(str(dirs / "target"), device="cpu", dtype="float32", speculative_config=sc,
               async_output=async_output, **kw)


def _params(stop: str) -> list[SamplingParams]:
    return [SamplingParams(temperature=0, max_tokens=21, ignore_eos=True),
            SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=17, ignore_eos=True),
            SamplingParams(temperature=0, max_tokens=30, stop=[stop], ignore_eos=True),
            SamplingParams(temperature=0, max_tokens=5)]


def _outputs(outs) -> list:
    return [(o.token_ids, o.text, o.finish_reason, o.outputs[0].stop_reason) for o in outs]


@pytest.mark.parametrize("spec", list(SPECS))
@pytest.mark.parametrize("kw", [{}, dict(max_num_batched_tokens=7), dict(block_size=4, num_kv_blocks=40)],
                         ids=["plain", "chunked", "preempting"])
def test_async_output_equals_synchronous_steps(dirs, spec, kw):
    sync = _llm(dirs, spec, False, **kw)
    probe = sync.generate(PROMPTS[2], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0].text
    stop = probe[8:11]  # completed by a token in the middle of a step (several tokens a step with speculation)
    params = [_params(stop)[i % 4] for i in range(len(PROMPTS))]
    ref = sync.generate(PROMPTS, params)
    llm = _llm(dirs, spec, True, **kw)
    got = llm.generate(PROMPTS, params)
    assert _outputs(got) == _outputs(ref)
    assert any(o.finish_reason == "stop" for o in got)
    if "num_kv_blocks" in kw:
        assert sum(o.metrics.num_preemptions for o in got) > 0
    pool = llm.engine.pool
    assert pool.num_free == pool.num_usable and llm.engine._in_flight is None


@pytest.mark.parametrize("spec", list(SPECS))
def test_a_step_is_reported_by_the_call_after_the_one_that_launched_it(dirs, spec):
    eng = _llm(dirs, spec, True).engine
    rid = eng.add_request(PROMPTS[1], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert eng.step() == [] and eng._in_flight is not None  # launched, not yet waited for
    deltas, ids, final, calls = [], [], None, 1
    while eng.has_unfinished_requests():
        calls += 1
        for out in eng.step():
            assert out.request_id == rid
            deltas.append(out.delta_text)
            ids += out.delta_token_ids
            final = out
    assert final.finished and len(final.token_ids) == 12
    assert "".join(deltas) == final.text and ids == final.token_ids
    assert eng._in_flight is None and calls == eng.num_steps + 1


@pytest.mark.parametrize("spec", list(SPECS))
def test_aborting_a_request_whose_step_is_running(dirs, spec):
    """The aborted request's running step is collected by the next call and dropped: no tokens, no output;
    its blocks are free and the request beside it finishes as it would alone."""
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    alone = _llm(dirs, spec, False).generate(PROMPTS[0], params)[0].token_ids
    eng = _llm(dirs, spec, True).engine
    gone, seen, final = abort_while_running(eng, params, 3)
    assert gone not in seen and final.request_id != gone and final.token_ids == alone
    assert eng.pool.num_free == eng.pool.num_usable


def test_a_failed_launch_after_a_collected_step_reports_that_step_first(dirs, monkeypatch):
    """The call that collects a step and then fails to launch the next returns the collected step's outputs
    (a request it finished is complete) and raises on the next call, as a synchronous engine would have."""
    eng = _llm(dirs, "no-spec", True).engine
    short = eng.add_request(PROMPTS[0], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    eng.add_request(PROMPTS[1], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    outs = []
    while not any(o.finished for o in outs):
        assert eng._error is None
        outs = eng.step()
        if eng._in_flight is not None and any(s.request.request_id == short and s.request.num_output_tokens == 2
                                              for s in eng._in_flight.batch.scheduled):

            def boom(batch):
                raise RuntimeError("device lost")

            monkeypatch.setattr(eng.runner, "launch", boom)
    assert [o.request_id for o in outs if o.finished] == [short] and eng._error is not None
    with pytest.raises(RuntimeError, match="device lost"):
        eng.step()
    assert eng._error is None
