"""Features together, drawn at random from a fixed seed: speculation (none, EAGLE-3, MTP-Eagle, vanilla MTP, trees,
trees that switch to chains), prefix caching, the overlap scheduler, CUDA-graph layouts (run without capture),
chunked prefill, preemption, few sequences, shared prompt prefixes, n > 1 and logprobs; every completion's greedy
tokens are plain decoding's, every block returns to the pool."""

from __future__ import annotations

import random

import pytest

from specserve import LLM, SamplingParams
from specserve.runner.cuda_graph import CudaGraphs
from tiny_models import make_head, make_hf_model


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("combos")
    make_hf_model(root / "t", "llama", initializer_range=0.4, num_hidden_layers=2)
    make_head(root / "e3", root / "t", "eagle3", own_head=False, seed=1)
    make_head(root / "mtp", root / "t", "mtp", num_modules=2, seed=2)
    return root


def _specs(root) -> list:
    e3, mtp = str(root / "e3"), str(root / "mtp")
    return [None, dict(method="eagle3", draft_model=e3, max_draft_len=3),
            dict(method="mtp", draft_model=mtp, max_draft_len=2),
            dict(method="mtp", draft_model=mtp, max_draft_len=2, mtp_eagle=False),
            dict(method="eagle3", draft_model=e3, max_draft_len=3, topk=2, max_total_draft_tokens=6),
            dict(method="eagle3", draft_model=e3, max_draft_len=4, topk=3, max_total_draft_tokens=10,
                 tree_max_batch_size=2)]


@pytest.mark.parametrize("seed", [3, 4])
def test_random_feature_combinations_keep_greedy_outputs(dirs, seed):
    rng = random.Random(seed)
    system = [rng.randrange(1, 300) for _ in range(40)]
    plain = LLM(str(dirs / "t"), device="cpu", dtype="float32", enable_prefix_caching=False)
    for trial in range(9):
        spec = rng.choice(_specs(dirs))
        kw = dict(enable_prefix_caching=rng.random() < 0.7, overlap_scheduler=rng.random() < 0.7, async_output=True)
        if rng.random() < 0.4:
            kw["max_num_batched_tokens"] = rng.choice([7, 16, 33])
        if rng.random() < 0.4:
            kw.update(block_size=4, num_kv_blocks=rng.choice([40, 60, 90]))
        if rng.random() < 0.3:
            kw["max_num_seqs"] = rng.choice([2, 3])
        graphs = rng.random() < 0.8
        llm = LLM(str(dirs / "t"), device="cpu", dtype="float32", speculative_config=spec, **kw)
        if graphs:
            llm.engine.runner.graphs = CudaGraphs(rng.choice([2, 4, 8]), llm.engine.runner._staging_buffers(),
                                                  capture=False)
        n = rng.randint(1, 8)
        prompts = [(system[:rng.randint(0, 40)] if rng.random() < 0.6 else [])
                   + [rng.randrange(1, 300) for _ in range(rng.randint(1, 25))] for _ in range(n)]
        params = [SamplingParams(temperature=0, max_tokens=rng.randint(1, 20), ignore_eos=True,
                                 logprobs=rng.choice([None, 0, 2]), n=rng.choice([1, 1, 1, 2, 3])) for _ in range(n)]
        got = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        for p, sp, o in zip(prompts, params, got):
            ref = plain.generate([{"prompt_token_ids": p}], SamplingParams(temperature=0, max_tokens=sp.max_tokens,
                                                                           ignore_eos=True), use_tqdm=False)[0]
            for c in o.outputs:
                assert c.token_ids == ref.token_ids, (trial, spec, kw, graphs)
                assert sp.logprobs is None or len(c.logprobs) == len(c.token_ids)
        pool = llm.engine.pool
        assert pool.num_free == pool.num_usable and llm.engine._in_flight is None, (trial, spec, kw)
