"""End to end on the real default model (SmolLM2-135M-Instruct, Q4_1 GGUF), float32 on the CPU."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.loaders import default_model_path

pytestmark = pytest.mark.slow

CHATS = [
    "What is the capital of France? Answer in one sentence and then explain why.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Give me three tips for staying focused while studying.",
    "Explain what a hash table is to a ten-year-old.",
]
N_TOKENS = 40


@pytest.fixture(scope="module")
def llm():
    return LLM(device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def prompts(llm):
    return [llm.tokenizer.apply_chat_template([{"role": "user", "content": c}]) for c in CHATS]


@pytest.fixture(scope="module")
def hf_greedy(prompts):
    """transformers' own GGUF loader (it dequantizes the file itself) with a plain greedy loop."""
    from transformers import AutoModelForCausalLM

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    model.eval()
    outs = []
    with torch.no_grad():
        for ids in prompts:
            out = model.generate(torch.tensor([ids]), max_new_tokens=N_TOKENS, do_sample=False,
                                 eos_token_id=None, pad_token_id=0, min_new_tokens=0)
            outs.append(out[0, len(ids):].tolist())
    return outs


def test_greedy_matches_transformers_on_gguf_weights(llm, prompts, hf_greedy):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=N_TOKENS, ignore_eos=True))
    for o, ref in zip(outs, hf_greedy):
        assert len(ref) == N_TOKENS
        assert o.token_ids == ref, (o.text, llm.tokenizer.decode(ref))


def test_batched_chunked_preempted_matches_single(prompts):
    single = LLM(device="cpu", dtype="float32")
    sp = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    ref = [single.generate([p], sp)[0].token_ids for p in prompts]
    del single
    tight = LLM(device="cpu", dtype="float32", num_kv_blocks=14, max_num_batched_tokens=37)
    outs = tight.generate([{"prompt_token_ids": p} for p in prompts], sp)
    assert [o.token_ids for o in outs] == ref
    assert sum(o.metrics.num_preemptions for o in outs) > 0
    assert tight.engine.pool.num_free == tight.engine.pool.num_usable


def test_chat_answer_is_sensible(llm):
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=30))[0]
    assert "Paris" in out.text
    assert out.finish_reason == "stop" and out.token_ids[-1] in llm.engine.model_config.eos_token_ids


def test_cli_generate_json():
    cmd = [sys.executable, "-m", "specserve.cli", "generate", "What is 2 + 2?", "word " * 80, "--json",
           "--max-tokens", "12", "--max-model-len", "64", "--device", "cpu"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr  # one prompt failed (longer than the context), the other ran
    lines = [json.loads(x) for x in proc.stdout.strip().splitlines()]
    assert len(lines) == 2
    assert lines[0]["text"] and len(lines[0]["token_ids"]) <= 12
    assert lines[0]["finish_reason"] in ("stop", "length")
    assert lines[1]["finish_reason"] == "error" and "context" in lines[1]["error"]
    assert "(--max-model-len)" in proc.stderr  # the CLI's words
