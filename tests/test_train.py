"""Draft-head training: training-time test matches the inference draft loop; a short run lowers the loss and
exports a head that loads and drafts; prompt files in common shapes."""

from __future__ import annotations

import gzip
import json

import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.train.attention import DenseCausal, TrainingTimeTest
from specserve.train.prompts import read_prompts
from specserve.train.trainer import TrainConfig, target_features, train
from tiny_models import make_head, make_hf_model


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    make_hf_model(root / "target", "llama", initializer_range=0.4, num_hidden_layers=8)
    make_head(root / "eagle3", root / "target", "eagle3", seed=1, own_head=False)
    make_head(root / "mtp", root / "target", "mtp", num_modules=1, seed=2)
    return root


def test_ttt_attention_step0_is_causal_attention():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 7, 4, 8, generator=g) for _ in range(3))
    kv = (k[:, :, :2], v[:, :, :2])
    ref = DenseCausal().attend(q, *kv, 0.3)
    assert torch.allclose(TrainingTimeTest().attend(q, *kv, 0.3), ref, atol=1e-6)


@pytest.mark.parametrize("method", ["eagle3", "mtp"])
def test_training_time_test_matches_the_inference_draft_loop(dirs, method):
    """Force the draft loop to feed the true next tokens; its outputs at chain step k must equal the
    training-time-test outputs of unroll step k at the same anchor."""
    d = 4
    llm = LLM(str(dirs / "target"), device="cpu", dtype="float32",
              speculative_config=dict(method=method, draft_model=str(dirs / method), max_draft_len=d))
    prompt = llm.tokenizer.encode("The quick brown fox jumps over the lazy dog. Hello world")
    ref = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=d + 3, ignore_eos=True))[0].token_ids
    seq = prompt + ref
    n0 = len(prompt)
    head = llm.engine.runner.head
    captured = []

    def forced(step, out):
        captured.append(out[0].clone())
        return torch.tensor([seq[n0 + 1 + step]])  # the true token at last_pos + step + 2

    head.draft_ids = forced
    eng = llm.engine
    eng.add_request(prompt, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    eng.step()  # prefill: head step 0 over the prompt, then the chain
    assert len(captured) == d
    del head.draft_ids

    tokens = torch.tensor([seq])
    with torch.no_grad():
        hidden, aux, _ = target_features(head.target, head, tokens)
        h = head.first_hidden(hidden, aux)
        pos = torch.arange(len(seq))[None]
        tta = TrainingTimeTest()
        for k in range(d):
            ids = torch.zeros_like(tokens)
            ids[:, :len(seq) - k - 1] = tokens[:, k + 1:]
            out = head.run_module(k, ids, pos + k, h, tta, (None, None))
            assert torch.allclose(out[0, n0 - 1], captured[k], atol=1e-4), k
            h = out


def test_short_training_lowers_loss_and_exports_a_working_head(dirs, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"instruction": f"Write about the fox number {i}.", "input": "briefly"})
                               + "\n" for i in range(30)))
    common = dict(target=str(dirs / "target"), prompts=[str(prompts)], device="cpu", steps=60, batch_size=4,
                  gen_max_tokens=24, warmup=5, lr=2e-3, eval_max_tokens=12, holdout=0.1, log_every=5)
    rep = train(TrainConfig(method="eagle3", out=str(tmp_path / "e3"), draft_vocab=120, **common))
    hist = rep["history"]
    first = sum(h["loss"] for h in hist[:2]) / 2
    last = sum(h["loss"] for h in hist[-2:]) / 2
    # soft cross-entropy includes the (high) entropy of a random target, so the drop is small in relative
    # terms; top-1 agreement with the target shows the head learning
    assert last < first - 0.2
    assert sum(h["acc"][0] for h in hist[-3:]) > 3 * sum(h["acc"][0] for h in hist[:2]) / 2 + 0.05
    assert (tmp_path / "e3" / "loss.png").is_file() and (tmp_path / "e3" / "acceptance.png").is_file()
    ev = rep["eval"]["holdout"]
    assert ev["prompts"] == 3 and 1.0 <= ev["acceptance_length"] <= 5.0
    assert len(ev["per_position_acceptance"]) == 4
    # the exported head loads, drafts and keeps greedy outputs unchanged
    head_dir = tmp_path / "e3" / "head"
    cfg = json.loads((head_dir / "config.json").read_text())
    assert cfg["draft_vocab_size"] == 120 and cfg["torch_dtype"] == "bfloat16"
    spec = LLM(str(dirs / "target"), device="cpu", dtype="float32",
               speculative_config=dict(method="eagle3", draft_model=str(head_dir), max_draft_len=3))
    plain = LLM(str(dirs / "target"), device="cpu", dtype="float32")
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    assert spec.generate("Hello world", sp)[0].token_ids == plain.generate("Hello world", sp)[0].token_ids
    assert spec.engine.spec_stats.num_drafted > 0
    # MTP-Eagle reuses the regenerated data of the first run; a second run resumes from its checkpoint
    rep2 = train(TrainConfig(method="mtp", out=str(tmp_path / "mtp"), data=str(tmp_path / "e3" / "data.pt"),
                             **dict(common, steps=20)))
    assert rep2["train_sequences"] == rep["train_sequences"]
    again = train(TrainConfig(method="mtp", out=str(tmp_path / "mtp"), data=str(tmp_path / "e3" / "data.pt"),
                              **dict(common, steps=30)))
    assert again["history"][0]["step"] == 0 and again["history"][-1]["step"] == 29
    # the first run logged steps 0, 5, 10, 15, 19; the resumed one adds 20, 25, 29
    assert [h["step"] for h in again["history"]] == [0, 5, 10, 15, 19, 20, 25, 29]


def test_prompt_file_shapes(tmp_path):
    recs = [
        {"prompt": "p1"},
        {"instruction": "i2", "input": "x"},
        {"instruction": "i3", "instances": [{"input": "y", "output": "z"}]},
        {"turns": ["t4", "second turn"]},
        {"conversations": [{"from": "system", "value": "s"}, {"from": "human", "value": "c5"}]},
        {"messages": [{"role": "user", "content": "m6"}]},
        {"prompt": "p1"},  # duplicate
        {"other": 1},
    ]
    jsonl = tmp_path / "a.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in recs))
    arr = tmp_path / "b.json"
    arr.write_text(json.dumps([{"prompt": "p7"}]))
    gz = tmp_path / "c.jsonl.gz"
    with gzip.open(gz, "wt") as f:
        f.write(json.dumps({"prompt": "p8"}) + "\n")
    got = read_prompts([jsonl, arr, gz])
    assert got == ["p1", "i2\n\nx", "i3\n\ny", "t4", "c5", "m6", "p7", "p8"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{not json\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        read_prompts([bad])
    with pytest.raises(ValueError, match="no prompts"):
        read_prompts([_write(tmp_path / "e.json", [{}])])


def _write(path, obj):
    path.write_text(json.dumps(obj))
    return path
