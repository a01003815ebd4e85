"""Tensor parallelism on the CPU (gloo, two processes started by the engine): greedy output with the model's
heads and MLP features split over two ranks equals one rank's (float32), with and without speculation, with
chunked prefill and preemption; seeded sampling gives the same tokens on every rank (they run in lockstep, and
rank 0 reports them); settings that cannot split are refused before any process starts."""

from __future__ import annotations

import pytest

from specserve import LLM, SamplingParams
from specserve.distributed import TensorParallel
from tiny_models import PROMPTS, make_head, make_hf_model

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp")
    # qwen2: biases on q/k/v (split with their rows); heads 4 and KV heads 2 split over two ranks
    make_hf_model(root / "target", "qwen2", initializer_range=0.4, num_hidden_layers=2)
    make_head(root / "eagle3", root / "target", "eagle3", own_head=False, seed=1)
    make_head(root / "mtp", root / "target", "mtp", num_modules=1, seed=2)
    # a vocabulary two ranks do not split evenly (the last rank's rows padded), tied to the embedding; an EAGLE-3
    # head drafting over some of the target's output rows (d2t), an MTP head on the whole output layer
    make_hf_model(root / "odd", "llama", vocab_size=321, tie_word_embeddings=True, initializer_range=0.4,
                  num_hidden_layers=2)
    make_head(root / "odd-eagle3", root / "odd", "eagle3", draft_vocab=200, own_head=False, seed=3)
    make_head(root / "odd-mtp", root / "odd", "mtp", num_modules=1, seed=4)
    return root


SPECS = {"no-spec": None, "eagle3": dict(method="eagle3", draft_model="eagle3", max_draft_len=3),
         "mtp_eagle-tree": dict(method="mtp", draft_model="mtp", max_draft_len=2, topk=2, max_total_draft_tokens=4)}


def _run(dirs, spec, tp: int, params, target="target", **kw):
    sc = None if SPECS[spec] is None else dict(SPECS[spec], draft_model=str(dirs / SPECS[spec]["draft_model"]))
    llm = LLM(str(dirs / target), device="cpu", dtype="float32", speculative_config=sc, tensor_parallel_size=tp,
              **kw)
    try:
        outs = llm.generate(PROMPTS * 2, params)
        return [o.token_ids for o in outs], llm.engine
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize("spec", list(SPECS))
@pytest.mark.parametrize("kw", [{}, dict(max_num_batched_tokens=7), dict(block_size=4, num_kv_blocks=40)],
                         ids=["plain", "chunked", "preempting"])
def test_two_ranks_give_one_ranks_greedy_tokens(dirs, spec, kw):
    one, _ = _run(dirs, spec, 1, GREEDY, **kw)
    two, eng = _run(dirs, spec, 2, GREEDY, **kw)
    assert two == one
    assert eng.model.layers[0].self_attn.hkv == 1 and eng.kv_cache.tensor.shape[-2] == 1  # half the KV heads
    if spec != "no-spec":
        assert eng.spec_stats.num_verify_steps > 0


@pytest.mark.parametrize("head", ["odd-eagle3", "odd-mtp"])
def test_a_vocabulary_split_unevenly_gives_one_ranks_tokens(dirs, head):
    """The embedding and the (tied) output layer split by vocabulary rows, 161 + 160 and a padding row: the
    target's logits gathered, and the head's input embeddings and drafts read through the same collectives.
    Every draft is accepted (forced acceptance), so the output is the head's drafts as much as the target's."""
    SPECS[head] = dict(method=head[4:], draft_model=head, max_draft_len=3, forced_acceptance=3)
    one, _ = _run(dirs, head, 1, GREEDY, target="odd")
    two, eng = _run(dirs, head, 2, GREEDY, target="odd")
    assert two == one
    assert eng.model.embed_tokens.weight.shape[0] == 161 and eng.model.lm_head is None
    assert eng.spec_stats.num_accepted > 0


def test_seeded_sampling_gives_one_ranks_tokens(dirs):
    """Every rank samples from the same all-reduced logits with the same seeds: the tokens are one rank's (were
    the ranks' samples to differ, their next steps would compute different sequences and the output would not
    match)."""
    params = [SamplingParams(temperature=0.9, top_p=0.9, seed=i, max_tokens=12, ignore_eos=True)
              for i in range(len(PROMPTS) * 2)]
    one, _ = _run(dirs, "eagle3", 1, params)
    two, _ = _run(dirs, "eagle3", 2, params)
    assert two == one


def test_a_rank_that_dies_stops_the_engine_with_an_error(dirs):
    llm = LLM(str(dirs / "target"), device="cpu", dtype="float32", tensor_parallel_size=2)
    worker = llm.engine.commands.workers[0]
    worker.kill()
    worker.join()
    with pytest.raises(RuntimeError, match="tensor-parallel rank 1 exited"):
        llm.generate(PROMPTS[0], GREEDY)
    llm.engine.shutdown()


def test_torchrun_ranks_give_the_single_rank_reply(dirs):
    """``torchrun --nproc-per-node 2 -m specserve.cli generate ... -tp 2``: rank 0 runs the command, rank 1 its
    steps; the reply is one rank's."""
    import subprocess
    import sys

    cmd = ["-m", "specserve.cli", "generate", "Hello world", "--model", str(dirs / "target"), "--device", "cpu",
           "--no-spec", "--max-tokens", "12", "--temperature", "0", "--ignore-eos"]
    one = subprocess.run([sys.executable, *cmd], capture_output=True, text=True, timeout=300)
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", *cmd, "-tp", "2"],
                         capture_output=True, text=True, timeout=300)
    assert one.returncode == 0 and two.returncode == 0, two.stderr[-2000:]
    assert two.stdout == one.stdout and one.stdout.strip()


def test_settings_that_cannot_split_are_refused(dirs):
    with pytest.raises(ValueError, match="tensor_parallel_size must be"):
        LLM(str(dirs / "target"), device="cpu", tensor_parallel_size=0)
    assert TensorParallel(1, 2).shard(8, "heads") == (4, 4)
    with pytest.raises(ValueError, match="does not divide the model's 3 heads"):
        TensorParallel(0, 2).shard(3, "heads")
