"""The heads shipped for the default model: acceptance stays at its stored baseline, and speculation with
them is lossless (CPU, float32, greedy)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specserve import LLM, SamplingParams
from specserve.heads import default_speculative_config

pytestmark = pytest.mark.slow

BASELINE = Path(__file__).parent / "data" / "shipped_heads_baseline.json"
CHATS = [
    "Write a Python function that returns the factorial of n.",
    "Give me three tips for better sleep.",
    "Explain what a linked list is.",
    "Write a short poem about autumn leaves.",
]
SP = SamplingParams(temperature=0, max_tokens=64)


@pytest.fixture(scope="module")
def prompts():
    llm = LLM(device="cpu", dtype="float32", num_kv_blocks=64)
    ids = [llm.tokenizer.apply_chat_template([{"role": "user", "content": c}]) for c in CHATS]
    plain = [o.token_ids for o in llm.generate([{"prompt_token_ids": p} for p in ids], SP)]
    return ids, plain


def measure(method: str, ids):
    llm = LLM(device="cpu", dtype="float32", num_kv_blocks=64,
              speculative_config=default_speculative_config(method, max_draft_len=4))
    outs = llm.generate([{"prompt_token_ids": p} for p in ids], SP)
    return [o.token_ids for o in outs], llm.engine.spec_stats


@pytest.mark.parametrize("method", ["eagle3", "mtp"])
def test_shipped_head_acceptance_and_losslessness(prompts, method):
    ids, plain = prompts
    tokens, stats = measure(method, ids)
    assert tokens == plain
    base = json.loads(BASELINE.read_text())[method]
    assert stats.acceptance_length == pytest.approx(base["acceptance_length"], rel=0.05)
    assert stats.acceptance_length > 1.5  # the head drafts something useful at all


def test_shipped_heads_fit_the_size_budget():
    for method in ("eagle3", "mtp"):
        head = Path(default_speculative_config(method)["draft_model"])
        assert (head / "model.safetensors").stat().st_size <= 15 * 2**20
        assert (head / "TRAINING.md").is_file() and (head / "report.json").is_file()


if __name__ == "__main__":  # regenerate the stored baseline: python tests/test_shipped_heads.py
    llm = LLM(device="cpu", dtype="float32", num_kv_blocks=64)
    ids = [llm.tokenizer.apply_chat_template([{"role": "user", "content": c}]) for c in CHATS]
    out = {}
    for m in ("eagle3", "mtp"):
        _, st = measure(m, ids)
        out[m] = {"acceptance_length": st.acceptance_length, "per_position_acceptance": st.per_position}
    BASELINE.write_text(json.dumps(out, indent=2) + "\n")
    print(out)
