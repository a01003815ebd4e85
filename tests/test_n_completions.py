"""``n`` completions per prompt: completion i is the n=1 request with seed + i, token for token (with and without
speculation, under preemption); the prompt's KV is computed once and forked (each completion holds the full prompt
blocks, computing only the prompt's partial last block); aborting the request aborts them all."""

from __future__ import annotations

import pytest

from specserve import LLM, SamplingParams
from tiny_models import PROMPTS, make_target_and_eagle3


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("n")
    make_target_and_eagle3(root)
    return root


def _llm(dirs, spec: bool, **kw) -> LLM:
    sc = dict(method="eagle3", draft_model=str(dirs / "eagle3"), max_draft_len=3) if spec else None
    return LLM(str(dirs / "target"), device="cpu", dtype="float32", speculative_config=sc, **kw)


@pytest.mark.parametrize("spec", [False, True], ids=["no-spec", "eagle3"])
@pytest.mark.parametrize("kw", [{}, dict(block_size=4, num_kv_blocks=40)], ids=["plain", "preempting"])
def test_completion_i_is_the_single_request_with_seed_plus_i(dirs, spec, kw):
    llm = _llm(dirs, spec, **kw)
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=11, n=3, max_tokens=12, ignore_eos=True, logprobs=1)
    outs = llm.generate(PROMPTS[:3], params)
    for p, o in zip(PROMPTS[:3], outs):
        assert o.finished and [c.index for c in o.outputs] == [0, 1, 2]
        for i, c in enumerate(o.outputs):
            single = llm.generate(p, SamplingParams(temperature=0.9, top_p=0.95, seed=11 + i, max_tokens=12,
                                                    ignore_eos=True))[0]
            assert c.token_ids == single.token_ids and c.text == single.text and len(c.logprobs) == 12
        assert len({tuple(c.token_ids) for c in o.outputs}) > 1  # the seeds differ, so do the completions
    assert llm.engine.pool.num_free == llm.engine.pool.num_usable and not llm.engine.families


def test_the_prompt_is_computed_once(dirs):
    """A 40-token prompt, n = 4, prefix caching off: the first completion computes 40 prompt tokens, each other
    one only the 8 past the last full block it shares (32 = 2 blocks of 16)."""
    llm = _llm(dirs, False, enable_prefix_caching=False)
    prompt = [(13 * i + 7) % 300 + 1 for i in range(40)]
    computed = []
    schedule = llm.engine.scheduler.schedule

    def spy():
        out = schedule()
        computed.extend(s.num_tokens for s in out.scheduled if not s.sample or s.start < 40)
        return out

    llm.engine.scheduler.schedule = spy
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=1.0, seed=2, n=4, max_tokens=5))[0]
    assert len(out.outputs) == 4
    assert sum(computed) == 40 + 3 * 8


def test_a_streamed_family_reports_each_completion_and_finishes_once(dirs):
    eng = _llm(dirs, True).engine
    rid = eng.add_request(PROMPTS[1], SamplingParams(temperature=0.8, seed=5, n=3, max_tokens=7, ignore_eos=True))
    deltas: dict[int, list[int]] = {0: [], 1: [], 2: []}
    finals = []
    while eng.has_unfinished_requests():
        for out in eng.step():
            assert out.request_id == rid
            deltas[out.delta_index] += out.delta_token_ids
            finals.append(out.finished)
    assert finals.count(True) == 1 and finals[-1]
    assert all(deltas[i] == out.outputs[i].token_ids and len(deltas[i]) == 7 for i in range(3))


def test_aborting_a_family_aborts_every_completion(dirs):
    eng = _llm(dirs, False).engine
    rid = eng.add_request(PROMPTS[2], SamplingParams(temperature=0.8, n=4, max_tokens=200, ignore_eos=True))
    keep = eng.add_request(PROMPTS[0], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    eng.step()  # the first completion prefills; the others wait to fork
    eng.abort_request(rid)
    seen = set()
    while eng.has_unfinished_requests():
        seen |= {o.request_id for o in eng.step()}
    assert seen == {keep} and not eng.families and eng.pool.num_free == eng.pool.num_usable
    with pytest.raises(ValueError, match="n"):
        SamplingParams(n=0)
