"""Log-probabilities of generated tokens (``SamplingParams.logprobs``): the target's distribution at each emitted
token, with its rank and the most likely tokens there; equal with speculation off and on (chains, trees, MTP),
under the overlap scheduler, and equal to transformers' for the first token."""

from __future__ import annotations

import math

import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.runner.cuda_graph import CudaGraphs
from tiny_models import PROMPTS, target_with_heads


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return target_with_heads(tmp_path_factory.mktemp("logprobs"))


SPECS = {
    "no-spec": None,
    "eagle3-d3": dict(method="eagle3", draft_model="eagle3", max_draft_len=3),
    "mtp_eagle-d2": dict(method="mtp", draft_model="mtp", max_draft_len=2),
    "eagle3-tree": dict(method="eagle3", draft_model="eagle3", max_draft_len=3, topk=2, max_total_draft_tokens=6),
}


def _llm(dirs, spec: str, **kw) -> LLM:
    sc = None if SPECS[spec] is None else dict(SPECS[spec], draft_model=str(dirs / SPECS[spec]["draft_model"]))
    return LLM(str(dirs / "target"), device="cpu", dtype="float32", speculative_config=sc, **kw)


def _flat(out) -> list:
    """Per token: (id, its logprob, its rank, the top tokens in order)."""
    rows = []
    for tok, entry in zip(out.token_ids, out.outputs[0].logprobs):
        top = sorted((lp.rank, tid) for tid, lp in entry.items() if tid != tok or lp.rank <= 3)
        rows.append((tok, entry[tok].logprob, entry[tok].rank, [tid for _, tid in top]))
    return rows


@pytest.mark.parametrize("spec", [s for s in SPECS if s != "no-spec"])
def test_logprobs_equal_with_and_without_speculation(dirs, spec):
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3),
              SamplingParams(temperature=0, max_tokens=9, ignore_eos=True),  # asks for none
              SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=0)]
    prompts = PROMPTS[:3]
    ref = _llm(dirs, "no-spec").generate(prompts, params)
    got = _llm(dirs, spec).generate(prompts, params)
    assert got[1].outputs[0].logprobs is None and ref[1].outputs[0].logprobs is None
    for r, g in zip((ref[0], ref[2]), (got[0], got[2])):
        assert g.token_ids == r.token_ids and len(g.outputs[0].logprobs) == len(g.token_ids)
        for (t1, lp1, rank1, top1), (t2, lp2, rank2, top2) in zip(_flat(r), _flat(g)):
            assert t1 == t2 and rank1 == rank2 == 1 and top1 == top2  # greedy: the token is the most likely
            assert lp2 == pytest.approx(lp1, abs=1e-4)
    assert all(len(e) == 3 for e in got[0].outputs[0].logprobs)  # the top 3, the chosen among them
    assert all(len(e) == 1 for e in got[2].outputs[0].logprobs)  # the chosen token only


def test_the_first_tokens_logprobs_are_transformers(dirs):
    from transformers import AutoModelForCausalLM

    llm = _llm(dirs, "no-spec")
    ids = llm.tokenizer.encode(PROMPTS[0])
    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0.8, seed=5, max_tokens=2,
                                                                   logprobs=5))[0]
    hf = AutoModelForCausalLM.from_pretrained(str(dirs / "target"), dtype=torch.float32)
    with torch.no_grad():
        lp = hf(torch.tensor([ids])).logits[0, -1].log_softmax(-1)
    first = out.outputs[0].logprobs[0]
    tok = out.token_ids[0]
    assert first[tok].logprob == pytest.approx(lp[tok].item(), abs=1e-4)
    assert first[tok].rank == int((lp > lp[tok]).sum()) + 1
    top = lp.topk(5)
    for j, (v, tid) in enumerate(zip(top.values.tolist(), top.indices.tolist())):
        assert first[tid].rank == j + 1 and first[tid].logprob == pytest.approx(v, abs=1e-4)
        assert first[tid].decoded_token == llm.tokenizer.decode([tid], skip_special_tokens=False)


@pytest.mark.parametrize("spec", ["no-spec", "eagle3-d3", "eagle3-tree"])
def test_logprobs_under_the_overlap_scheduler(dirs, spec):
    params = [SamplingParams(temperature=0, max_tokens=11, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0.9, seed=8, max_tokens=9, ignore_eos=True, logprobs=1)]
    prompts = PROMPTS[:4]
    ps = [params[i % 2] for i in range(4)]
    ref = _llm(dirs, spec).generate(prompts, ps)
    llm = _llm(dirs, spec, overlap_scheduler=True, async_output=True)
    llm.engine.runner.graphs = CudaGraphs(8, llm.engine.runner._staging_buffers(), capture=False)
    got = llm.generate(prompts, ps)
    for r, g in zip(ref, got):
        assert g.token_ids == r.token_ids
        for (t1, lp1, rank1, top1), (t2, lp2, rank2, top2) in zip(_flat(r), _flat(g)):
            assert (t1, rank1, top1) == (t2, rank2, top2) and lp2 == pytest.approx(lp1, abs=1e-4)
        assert all(lp.logprob <= 0 and math.isfinite(lp.logprob) for e in g.outputs[0].logprobs for lp in e.values())
    assert llm.engine.runner.graphs.steps > 0  # the graph layouts ran (rows that fit no graph run packed)


def test_logprobs_are_checked():
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=21)
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=True)
