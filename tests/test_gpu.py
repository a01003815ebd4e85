"""CUDA runs (skipped without a GPU; run on the GPU machine: ``pytest -m gpu``)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from specserve import LLM, SamplingParams
from tiny_models import make_hf_model

pytestmark = pytest.mark.gpu

PROMPTS = ["Hello world", "The quick brown fox jumps over the lazy dog.", "def main(): return 42", "fox"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_gpu")
    make_hf_model(d, "llama", initializer_range=0.4, num_hidden_layers=2)
    return str(d)


def test_cuda_float32_matches_cpu(model_dir):
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    cpu = LLM(model_dir, device="cpu", dtype="float32").generate(PROMPTS, sp)
    gpu_llm = LLM(model_dir, device="cuda", dtype="float32", max_num_batched_tokens=7, kv_cache_memory_bytes=1 << 26)
    gpu = gpu_llm.generate(PROMPTS, sp)
    assert [o.token_ids for o in gpu] == [o.token_ids for o in cpu]
    assert gpu_llm.engine.pool.num_free == gpu_llm.engine.pool.num_usable


def test_cuda_seeded_sampling_matches_cpu(model_dir):
    # the sampler's noise is integer hashing, so CPU and CUDA draw the same tokens from the same logits
    sp = SamplingParams(temperature=0.7, top_p=0.9, seed=5, max_tokens=16, ignore_eos=True)
    cpu = LLM(model_dir, device="cpu", dtype="float32").generate(PROMPTS[:2], sp)
    gpu = LLM(model_dir, device="cuda", dtype="float32", kv_cache_memory_bytes=1 << 26).generate(PROMPTS[:2], sp)
    assert [o.token_ids for o in gpu] == [o.token_ids for o in cpu]


def test_default_model_bf16_on_cuda():
    path = os.environ.get("SPECSERVE_TEST_GGUF")
    if path is None:
        from specserve.loaders import default_model_path

        try:
            path = str(default_model_path())
        except ValueError:
            pytest.skip("default model not installed and SPECSERVE_TEST_GGUF not set")
    assert Path(path).is_file()
    llm = LLM(path, device="cuda", dtype="bfloat16", kv_cache_memory_bytes=1 << 30)
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=30))[0]
    assert "Paris" in out.text
    assert llm.engine.model.embed_tokens.weight.dtype == torch.bfloat16


@pytest.mark.parametrize("method, modules", [("eagle3", 1), ("mtp", 1), ("mtp", 3)])
def test_cuda_speculation_is_lossless(tmp_path_factory, method, modules):
    from tiny_models import make_head

    d = tmp_path_factory.mktemp(f"spec_gpu_{method}{modules}")
    make_hf_model(d / "t", "llama", initializer_range=0.4, num_hidden_layers=8)
    make_head(d / "h", d / "t", method, num_modules=modules, draft_vocab=150)
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    common = dict(device="cuda", dtype="float32", kv_cache_memory_bytes=1 << 26)
    plain = LLM(str(d / "t"), **common).generate(PROMPTS, sp)
    spec = dict(method=method, draft_model=str(d / "h"), max_draft_len=3)
    llm = LLM(str(d / "t"), speculative_config=spec, max_num_batched_tokens=7, **common)
    out = llm.generate(PROMPTS, sp)
    assert [o.token_ids for o in out] == [o.token_ids for o in plain]
    assert llm.engine.spec_stats.num_verify_steps > 0
    assert llm.engine.pool.num_free == llm.engine.pool.num_usable


@pytest.mark.parametrize("method", [None, "eagle3", "mtp"])
def test_cuda_overlap_scheduler_equals_synchronous_steps(tmp_path_factory, method):
    """Captured graphs whose rows are corrected on the device from the step before (the overlap scheduler, on by
    default on CUDA) give the tokens of the synchronous engine, greedy and seeded, with requests joining running
    ones and ending on stop tokens. Float32: the overlap scheduler admits a request one step later than the
    synchronous engine (the step that ends a request is collected after the next is scheduled), so steps hold
    other row counts, and in bf16 another row count can take another GEMM kernel and rounding (on the H100 the
    tiny model's outputs parted after 20-30 tokens)."""
    from tiny_models import make_head

    d = tmp_path_factory.mktemp(f"overlap_gpu_{method}")
    make_hf_model(d / "t", "llama", initializer_range=0.4, num_hidden_layers=4)
    spec = None
    if method is not None:
        make_head(d / "h", d / "t", method, draft_vocab=150)
        spec = dict(method=method, draft_model=str(d / "h"), max_draft_len=3)
    prompts = PROMPTS * 3
    params = [SamplingParams(temperature=0, max_tokens=10 + 3 * i, ignore_eos=True) if i % 2 else
              SamplingParams(temperature=0.8, top_k=20, seed=i, max_tokens=12 + i, ignore_eos=True)
              for i in range(len(prompts))]
    outs = {}
    for overlap in (False, True):
        llm = LLM(str(d / "t"), device="cuda", dtype="float32", speculative_config=spec, max_num_seqs=4,
                  kv_cache_memory_bytes=1 << 26, overlap_scheduler=overlap)
        outs[overlap] = [o.token_ids for o in llm.generate(prompts, params)]
        assert llm.engine.overlap is overlap and llm.engine.pool.num_free == llm.engine.pool.num_usable
    assert outs[True] == outs[False]


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_cuda_steps_drafting_nothing_run_as_plain_graphs_losslessly(tmp_path_factory, overlap):
    """Runs of D = 0 between drafting steps in captured graphs: a step that verifies and drafts nothing replays the
    plain graph (under the overlap scheduler its tokens go to the carry as a speculator's rows that accepted
    nothing, and the next step, plain or drafting, reads them through the correction kernel), and greedy output
    stays that of no speculation (float32)."""
    from tiny_models import make_head

    d = tmp_path_factory.mktemp(f"plain_steps_gpu_{overlap}")
    make_hf_model(d / "t", "llama", initializer_range=0.4, num_hidden_layers=4)
    make_head(d / "h", d / "t", "eagle3", draft_vocab=150)
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    common = dict(device="cuda", dtype="float32", kv_cache_memory_bytes=1 << 26, max_num_seqs=4,
                  overlap_scheduler=overlap)
    plain = [o.token_ids for o in LLM(str(d / "t"), **common).generate(PROMPTS * 2, sp)]
    spec = dict(method="eagle3", draft_model=str(d / "h"), max_draft_len=3, draft_len_schedule={64: 3})
    llm = LLM(str(d / "t"), speculative_config=spec, **common)
    pattern, steps = [0, 0, 0, 0, 3, 3, 0, 0, 0, 1, 2], []
    llm.engine.draft_policy.choose = lambda *a, **k: steps.append(1) or pattern[len(steps) % len(pattern)]
    keys = []
    run = llm.engine.runner.graphs.run
    llm.engine.runner.graphs.run = lambda key, *a, **k: keys.append(key) or run(key, *a, **k)
    assert [o.token_ids for o in llm.generate(PROMPTS * 2, sp)] == plain
    kinds = {key.kind[1] for key in keys if not key.layout.prefill}
    assert {-1, 3} <= kinds, kinds
    assert llm.engine.pool.num_free == llm.engine.pool.num_usable


def test_cuda_draft_trees_are_lossless_with_graphs_and_overlap(tmp_path_factory):
    """Draft trees on CUDA (captured graphs, the tree mask in the Triton attention kernel, the overlap scheduler),
    with steps above ``tree_max_batch_size`` drafting chains, or each step's kind chosen by measured cost, give
    plain greedy decoding's tokens."""
    from tiny_models import make_head

    d = tmp_path_factory.mktemp("tree_gpu")
    make_hf_model(d / "t", "llama", initializer_range=0.4, num_hidden_layers=4)
    make_head(d / "h", d / "t", "eagle3", draft_vocab=150)
    prompts = PROMPTS * 2
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    common = dict(device="cuda", dtype="float32", kv_cache_memory_bytes=1 << 26, max_num_seqs=6)
    plain = [o.token_ids for o in LLM(str(d / "t"), **common).generate(prompts, sp)]
    spec = dict(method="eagle3", draft_model=str(d / "h"), max_draft_len=3, topk=3, max_total_draft_tokens=8,
                tree_max_batch_size=3)
    for overlap in (False, True):
        llm = LLM(str(d / "t"), speculative_config=spec, overlap_scheduler=overlap, **common)
        assert [o.token_ids for o in llm.generate(prompts, sp)] == plain
        assert llm.engine.spec_stats.num_verify_steps > 0
        assert llm.engine.pool.num_free == llm.engine.pool.num_usable
    # the default: each chain length's step and the tree's measured per batch bucket at start (graph replays),
    # each step drafting the option of most expected tokens per second
    spec.pop("tree_max_batch_size")
    for overlap in (False, True):
        llm = LLM(str(d / "t"), speculative_config=spec, overlap_scheduler=overlap, **common)
        costs = llm.engine.draft_policy.costs
        # a column per option: chains of 1..3 drafts, the tree
        assert costs.buckets == [1, 2, 4, 6] and all(len(s) == 4 and min(s) > 0 for s in costs.seconds)
        assert [o.token_ids for o in llm.generate(prompts, sp)] == plain
        assert llm.engine.pool.num_free == llm.engine.pool.num_usable


def test_cuda_draft_trees_of_24_nodes_at_32_rows_under_overlap(tmp_path_factory):
    """The stage-`trees` shape (top-4 x depth 6, 24 nodes) at 16 and 32 rows with the overlap scheduler, tree and
    chain steps in turn (rows continuing either kind): plain greedy's tokens and no device fault. (At these sizes
    the tree engine reached an illegal address on the H100, with the kind chosen by cost.)"""
    from tiny_models import make_head

    d = tmp_path_factory.mktemp("tree_gpu_32")
    make_hf_model(d / "t", "llama", initializer_range=0.4, num_hidden_layers=4)
    make_head(d / "h", d / "t", "eagle3", draft_vocab=150)
    prompts = [p + " " * i for i in range(8) for p in PROMPTS]  # 32 prompts
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    common = dict(device="cuda", dtype="float32", kv_cache_memory_bytes=1 << 27, max_num_seqs=32)
    plain = [o.token_ids for o in LLM(str(d / "t"), **common).generate(prompts, sp)]
    spec = dict(method="eagle3", draft_model=str(d / "h"), max_draft_len=6, topk=4, max_total_draft_tokens=24)
    llm = LLM(str(d / "t"), speculative_config=spec, overlap_scheduler=True, **common)
    policy, steps = llm.engine.draft_policy, []
    choose = policy.choose

    # the tree (24), then chains of 1..6 drafts longer and shorter than the one before, runs of one length
    pattern = [24, 2, 5, 1, 24, 6, 3, 3, 4, 24, 1, 1]

    def alternate(requests, generation=False, captured=None, verifying=0):
        choose(requests, generation, captured, verifying)  # step: rows continue either kind
        steps.append(1)
        drafts = pattern[len(steps) % len(pattern)]
        policy.option = policy.tree_option if drafts == 24 else drafts - 1
        return drafts

    policy.choose = alternate
    for rows in (16, 32):
        llm.engine.scheduler.cfg.max_num_seqs = rows
        assert [o.token_ids for o in llm.generate(prompts, sp)] == plain, rows
    torch.cuda.synchronize()
    by_len = llm.engine.spec_stats.steps_by_draft_len
    assert len(by_len) > 24 and all(by_len[1:7]) and by_len[24] > 0, by_len  # chains of 1..6 drafts, trees (24)
    assert llm.engine.pool.num_free == llm.engine.pool.num_usable
