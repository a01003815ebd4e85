"""``SamplingParams.output_kind`` (vLLM's ``RequestOutputKind``): a FINAL_ONLY request is reported once, by the step
that ends it, with the same text, token ids, log-probabilities and finish reason as a CUMULATIVE one (its text
decoded once at the end instead of step by step); ``LLM.generate`` asks for FINAL_ONLY without changing the
caller's parameters."""

from __future__ import annotations

import dataclasses

import pytest

from specserve import LLM, RequestOutputKind, SamplingParams
from tiny_models import PROMPTS, make_target_and_eagle3


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("output_kind")
    make_target_and_eagle3(root)
    return root


def _run(llm: LLM, params: SamplingParams) -> tuple[list, int]:
    """Every prompt through ``LLMEngine.step`` -> (the last output of each request in prompt order, how many
    outputs the steps reported in all)."""
    eng = llm.engine
    ids = [eng.add_request(p, params) for p in PROMPTS]
    last, reported = {}, 0
    while eng.has_unfinished_requests():
        for o in eng.step():
            reported += 1
            last[o.request_id] = o
    return [last[i] for i in ids], reported


def _summary(o) -> list:
    return [o.finished] + [(c.index, c.text, c.token_ids, c.finish_reason, c.stop_reason,
                            None if c.logprobs is None else [sorted(d) for d in c.logprobs]) for c in o.outputs]


@pytest.mark.parametrize("spec", [False, True], ids=["no-spec", "eagle3"])
@pytest.mark.parametrize("extra", [dict(ignore_eos=True), dict(stop=["e", "a b"]), dict(n=3, seed=5, temperature=0.8),
                                   dict(logprobs=2, ignore_eos=True)], ids=["greedy", "stop", "n3", "logprobs"])
def test_final_only_reports_once_what_cumulative_reports_last(dirs, spec, extra):
    sc = dict(method="eagle3", draft_model=str(dirs / "eagle3"), max_draft_len=3) if spec else None
    llm = LLM(str(dirs / "target"), device="cpu", dtype="float32", speculative_config=sc)
    params = SamplingParams(**{"temperature": 0, "max_tokens": 24, **extra})
    cumulative, every = _run(llm, params)
    final, once = _run(llm, dataclasses.replace(params, output_kind=RequestOutputKind.FINAL_ONLY))
    assert [_summary(o) for o in final] == [_summary(o) for o in cumulative]
    assert all(o.finished for o in final) and once == len(PROMPTS) < every
    # the engine counts every token either way (the server's throughput log reads it)
    assert llm.engine.num_generated_tokens == 2 * sum(len(c.token_ids) for o in final for c in o.outputs)
    assert any(c.text for o in final for c in o.outputs)  # texts to compare, not empty ones
    if "stop" in extra:
        assert any(c.finish_reason == "stop" for o in final for c in o.outputs)


def test_generate_asks_for_final_only_and_leaves_the_callers_params(dirs):
    llm = LLM(str(dirs / "target"), device="cpu", dtype="float32")
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    reported = []
    step = llm.engine.step

    def counting_step():
        outs = step()
        reported.extend(outs)
        return outs

    llm.engine.step = counting_step
    outs = llm.generate(PROMPTS[:3], [params, params, SamplingParams(temperature=0, max_tokens=4)])
    assert len(reported) == 3 and all(o.finished for o in reported)
    assert [len(o.outputs[0].token_ids) for o in outs] == [8, 8, 4]
    assert params.output_kind == RequestOutputKind.CUMULATIVE
    with pytest.raises(ValueError, match="output_kind"):
        SamplingParams(output_kind=1)
