"""Draft-head training: training-time test matches the inference draft loop; a short run lowers the loss and
exports a head that loads and drafts; prompt files in common shapes. Starting from exported heads:
test_train_init.py."""

from __future__ import annotations

import gzip
import json

import pytest
import torch
from safetensors.torch import load_file

from specserve import LLM, SamplingParams
from specserve.train.attention import DenseCausal, TrainingTimeTest
from specserve.train.prompts import read_prompts
from specserve.train.trainer import (TrainConfig, build_head, make_batch, regenerate, target_features, train,
                                     ttt_loss)
from tiny_models import make_train_dirs


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return make_train_dirs(tmp_path_factory.mktemp("train"))


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
    # prefix caching off: the request below prefills its whole prompt in one pass, as the training-time test
    # computes it (a cached prefix's KV, computed in another pass, may differ in the last bits)
    llm = LLM(str(dirs / "target"), device="cpu", dtype="float32", enable_prefix_caching=False,
              speculative_config=dict(method=method, draft_model=str(dirs / method), max_draft_len=d))
    prompt = llm.tokenizer.encode("The quick brown fox jumps over the lazy dog. Hello world")
    ref = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=d + 3, ignore_eos=True))[0].token_ids
    seq = prompt + ref
    n0 = len(prompt)
    head = llm.engine.head
    captured = []

    def forced(step, out, dest=None):  # a new tensor: the draft loop places it in its result column
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
        hidden, aux = target_features(head.target, head, tokens)
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
    rep = train(TrainConfig(method="eagle3", out=str(tmp_path / "e3"), draft_vocab=120, aux_layers=(6, 0, 7),
                            dev_set_size=2, **common))
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
    # development sets: the held-out prompts as their file's category, and math word problems
    assert set(rep["dev"]) == {"prompts", "math"} and rep["dev"]["math"]["prompts"] == 2
    assert all(len(d["per_position_acceptance"]) == 4 for d in rep["dev"].values())
    assert (tmp_path / "e3" / "acceptance-by-category.png").is_file()
    # the exported head loads, drafts and keeps greedy outputs unchanged
    head_dir = tmp_path / "e3" / "head"
    cfg = json.loads((head_dir / "config.json").read_text())
    assert cfg["draft_vocab_size"] == 120 and cfg["torch_dtype"] == "bfloat16"
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 7, 8]  # inputs of layers = outputs + 1
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
    hist = rep2["history"]
    assert sum(h["loss"] for h in hist[-2:]) < sum(h["loss"] for h in hist[:2]) - 0.2
    mtp = LLM(str(dirs / "target"), device="cpu", dtype="float32",
              speculative_config=dict(method="mtp", draft_model=str(tmp_path / "mtp" / "head"), max_draft_len=3))
    assert mtp.generate("Hello world", sp)[0].token_ids == plain.generate("Hello world", sp)[0].token_ids
    assert mtp.engine.spec_stats.num_drafted > 0
    again = train(TrainConfig(method="mtp", out=str(tmp_path / "mtp"), data=str(tmp_path / "e3" / "data.pt"),
                              **dict(common, steps=30)))
    assert again["history"][0]["step"] == 0 and again["history"][-1]["step"] == 29
    # the first run logged steps 0, 5, 10, 15, 19; the resumed one adds 20, 25, 29
    assert [h["step"] for h in again["history"]] == [0, 5, 10, 15, 19, 20, 25, 29]


@pytest.mark.parametrize("method,draft_vocab,shared", [("eagle3", 0, False), ("eagle3", 50, False),
                                                       ("eagle3", 50, True), ("mtp", 0, False)])
def test_ttt_loss_equals_a_dense_per_position_reference(dirs, method, draft_vocab, shared):
    """The loss gathers response positions before the vocabulary-sized work; it must equal the plain
    definition: mean over response tokens of soft cross-entropy against the target, per unroll step."""
    from specserve.loaders import load_model

    target = load_model(str(dirs / "target"), torch.float32, "cpu").model
    cfg = TrainConfig(target=None, method=method, prompts=["x"], out="unused", draft_vocab=draft_vocab,
                      draft_vocab_shared=shared)
    g = torch.Generator().manual_seed(3)
    data = [{"prompt_ids": torch.randint(0, 100, (int(n),), generator=g).tolist(),
             "response_ids": torch.randint(0, 100, (int(r),), generator=g).tolist()}
            for n, r in zip(torch.randint(2, 9, (5,), generator=g), torch.randint(1, 12, (5,), generator=g))]
    head = build_head(cfg, target, data)
    with torch.no_grad():
        for p in head.parameters():
            if p.requires_grad and p.dim() > 1:
                p.normal_(0, 0.05, generator=g)
    tokens, lengths, starts = make_batch(data, list(range(5)), 16, "cpu")
    hidden, aux = target_features(target, head, tokens)
    loss, losses, _ = ttt_loss(cfg, head, tokens, lengths, starts, hidden, aux)

    with torch.no_grad():
        tgt = target.compute_logits(hidden).softmax(-1)  # [B, S, V]
        ids_v = head.vocab_ids()
        h = head.first_hidden(hidden, aux)
        tta = TrainingTimeTest()
        b, s = tokens.shape
        pos = torch.arange(s).expand(b, s)
        ref = []
        for k in range(cfg.ttt_steps):
            ids = torch.zeros_like(tokens)
            ids[:, :s - k - 1] = tokens[:, k + 1:]
            out = head.run_module(k, ids, pos + k, h, tta, (None, None))
            terms = []
            for bi in range(b):
                for i in range(s):
                    pred = i + k + 2  # the token this anchor drafts at unroll step k
                    if starts[bi] <= pred < lengths[bi]:
                        p = tgt[bi, pred - 1]
                        if ids_v is not None:
                            p = p[ids_v] / p[ids_v].sum()
                        terms.append(-(p * head.logits(k, out[bi, i]).log_softmax(-1)).sum())
            ref.append(torch.stack(terms).mean().item())
            h = out
    assert losses == pytest.approx(ref, rel=1e-5)
    w = [cfg.ttt_decay ** k for k in range(cfg.ttt_steps)]
    assert loss.item() == pytest.approx(sum(a * c for a, c in zip(w, ref)) / sum(w), rel=1e-5)


def test_a_batch_without_response_tokens_is_skipped(dirs):
    from specserve.loaders import load_model

    target = load_model(str(dirs / "target"), torch.float32, "cpu").model
    cfg = TrainConfig(target=None, method="eagle3", prompts=["x"], out="unused")
    data = [{"prompt_ids": list(range(1, 9)), "response_ids": [5, 6]}]
    head = build_head(cfg, target, data)
    tokens, lengths, starts = make_batch(data, [0], 8, "cpu")  # the response is cut off by max_len
    hidden, aux = target_features(target, head, tokens)
    assert ttt_loss(cfg, head, tokens, lengths, starts, hidden, aux) == (None, [], [])


def test_regeneration_in_worker_processes_equals_one_process(dirs, tmp_path):
    prompts = [f"Tell me about the number {i}." for i in range(7)]
    base = dict(target=str(dirs / "target"), method="eagle3", prompts=["unused"], out=str(tmp_path), device="cpu",
                gen_max_tokens=6, gen_temperature=0.8)
    one = regenerate(TrainConfig(**base), prompts)
    two = regenerate(TrainConfig(**base, gen_workers=2), prompts)
    assert len(one) == 7 and one == two


def test_regenerate_only_writes_data_and_stops(dirs, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Say {i}."}) + "\n" for i in range(6)))
    rep = train(TrainConfig(target=str(dirs / "target"), method="mtp", prompts=[str(prompts)], out=str(tmp_path / "o"),
                            device="cpu", gen_max_tokens=4, regenerate_only=True))
    assert rep["regenerated"] == 5  # one of six held out
    assert (tmp_path / "o" / "data.pt").is_file() and not (tmp_path / "o" / "head").exists()


def test_data_files_combine_and_must_share_their_held_out_prompts(dirs, tmp_path):
    """Greedy and sampled regenerations of the same prompts train one head; data regenerated from another
    split is refused (it would put held-out prompts into training)."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Count to {i}."}) + "\n" for i in range(6)))
    base = dict(target=str(dirs / "target"), method="eagle3", prompts=[str(prompts)], device="cpu",
                gen_max_tokens=5, regenerate_only=True)
    train(TrainConfig(out=str(tmp_path / "greedy"), **base))
    train(TrainConfig(out=str(tmp_path / "t1"), gen_temperature=1.0, **base))
    train(TrainConfig(out=str(tmp_path / "t1b"), gen_temperature=1.0, gen_seed=7, **base))
    train(TrainConfig(out=str(tmp_path / "other"), **dict(base, seed=3)))
    files = [str(tmp_path / n / "data.pt") for n in ("greedy", "t1", "t1b", "other")]
    greedy, t1, t1b, other = (torch.load(f) for f in files)
    assert t1["holdout_prompts"] == t1b["holdout_prompts"] == greedy["holdout_prompts"] != other["holdout_prompts"]
    assert t1["train"] != t1b["train"]  # --gen-seed changes the samples, not the split
    rep = train(TrainConfig(target=str(dirs / "target"), method="eagle3", prompts=[], out=str(tmp_path / "h"),
                            device="cpu", data=files[:3], steps=2, batch_size=2, eval_max_prompts=1,
                            eval_max_tokens=2))
    assert rep["train_sequences"] == 15
    with pytest.raises(ValueError, match="another file holds out"):
        train(TrainConfig(target=str(dirs / "target"), method="eagle3", prompts=[], out=str(tmp_path / "x"),
                          device="cpu", data=[files[0], files[3]], steps=2))
    for f in files[:3]:  # files written before data.pt listed its training prompts
        d = torch.load(f)
        del d["train_prompts"]
        torch.save(d, f)
    with pytest.raises(ValueError, match="held-out prompts differ"):
        train(TrainConfig(target=str(dirs / "target"), method="eagle3", prompts=[], out=str(tmp_path / "y"),
                          device="cpu", data=[files[0], files[3]], steps=2))
    rep = train(TrainConfig(target=str(dirs / "target"), method="eagle3", prompts=[], out=str(tmp_path / "h2"),
                            device="cpu", data=files[:3], steps=1, batch_size=2, eval_max_prompts=1,
                            eval_max_tokens=2))
    assert rep["train_sequences"] == 15
    with pytest.raises(ValueError, match="regenerate-only"):
        TrainConfig(target=None, method="mtp", prompts=[], out="o", data=files[0], regenerate_only=True)


def test_prompt_file_shapes(tmp_path):
    recs = [
        {"prompt": "p1"},
        {"instruction": "i2", "input": "x"},
        {"instruction": "i3", "instances": [{"input": "y", "output": "z"}]},
        {"turns": ["t4", "second turn"]},
        {"conversations": [{"from": "system", "value": "s"}, {"from": "human", "value": "c5"}]},
        {"messages": [{"role": "user", "content": "m6"}]},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "m6b"}]}]},  # OpenAI content parts
        {"conversations": [{"from": "human", "value": None}, {"from": "human", "value": "c6c"}]},  # empty turn
        {"turns": [None, "t6d"]},
        {"prompt": "p1"},  # duplicate
        {"other": 1},
    ]
    jsonl = tmp_path / "a.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in recs))
    arr = tmp_path / "b.json"
    arr.write_text(json.dumps([{"prompt": "p7"}]))
    gz = tmp_path / "c.JSONL.GZ"
    with gzip.open(gz, "wt") as f:
        f.write(json.dumps({"prompt": "p8"}) + "\n")
    pretty = tmp_path / "d.json"  # one object over several lines, with a byte-order mark
    pretty.write_text("\ufeff" + json.dumps({"prompt": "p9"}, indent=2), encoding="utf-8")
    got = read_prompts([jsonl, arr, gz, pretty])
    assert got == ["p1", "i2\n\nx", "i3\n\ny", "t4", "c5", "m6", "m6b", "c6c", "t6d", "p7", "p8", "p9"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{not json\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        read_prompts([bad])
    with pytest.raises(ValueError, match="no prompts"):
        read_prompts([_write(tmp_path / "e.json", [{}])])


def _write(path, obj):
    path.write_text(json.dumps(obj))
    return path


def test_learning_rate_decays_over_the_time_limit_when_it_comes_first():
    from specserve.train.trainer import _lr

    cfg = TrainConfig(target=None, method="eagle3", prompts=["x"], out="unused", steps=1000, warmup=10, lr=1.0,
                      time_limit=100.0)
    assert _lr(cfg, 5) == pytest.approx(0.6)  # warm-up
    assert _lr(cfg, 10, elapsed=0.0) == pytest.approx(1.0)
    assert _lr(cfg, 20, elapsed=50.0) == pytest.approx(0.55)  # half the time: half-way down the cosine
    assert _lr(cfg, 20, elapsed=100.0) == pytest.approx(0.1)
    assert _lr(cfg, 1000, elapsed=1.0) == pytest.approx(0.1)  # steps exhausted first


def test_aux_layers_are_validated(dirs, tmp_path):
    from specserve.loaders import load_model

    with pytest.raises(ValueError, match="eagle3 only"):
        TrainConfig(target=None, method="mtp", prompts=["x"], out="o", aux_layers=(1, 2, 3))
    target = load_model(str(dirs / "target"), torch.float32, "cpu").model
    for bad in ((1, 2), (1, 1, 2), (0, 3, 8)):  # 8 layers: ids 0..7
        with pytest.raises(ValueError, match="three different layer ids"):
            build_head(TrainConfig(target=None, method="eagle3", prompts=["x"], out="o", aux_layers=bad), target, [])
    # the default layers of a target too shallow for three distinct ones are repeated, not refused
    shallow = load_model(str(dirs / "target"), torch.float32, "cpu").model
    shallow.config.num_hidden_layers = 4
    head = build_head(TrainConfig(target=None, method="eagle3", prompts=["x"], out="o"), shallow, [])
    assert head.aux_layers == (1, 1, 0)
    # train() refuses them before regenerating anything
    with pytest.raises(ValueError, match="three different layer ids"):
        train(TrainConfig(target=str(dirs / "target"), method="eagle3", prompts=["missing.jsonl"],
                          out=str(tmp_path / "o"), aux_layers=(0, 1, 8)))
    assert not (tmp_path / "o").exists()


def test_stop_after_pauses_and_the_time_budget_spans_resumes(dirs, tmp_path):
    """--stop-after checkpoints and exits without exporting; the training seconds are kept in the checkpoint,
    so a resumed run's --time-limit (and LR decay) counts the time already trained."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Name a colour, {i}."}) + "\n" for i in range(8)))
    base = dict(target=str(dirs / "target"), method="mtp", prompts=[str(prompts)], out=str(tmp_path / "o"),
                device="cpu", gen_max_tokens=6, batch_size=2, log_every=1, eval_max_prompts=1, eval_max_tokens=4,
                target_dtype="bfloat16")  # (and the bf16 training path end to end)
    rep = train(TrainConfig(steps=6, stop_after=0.0, **base))
    assert rep["paused"] and rep["step"] == 0 and not (tmp_path / "o" / "head").exists()
    rep = train(TrainConfig(steps=6, **base))  # resumes and finishes
    assert [h["step"] for h in rep["history"]] == list(range(6)) and (tmp_path / "o" / "head").is_dir()
    # seeded: the paused and resumed run trains the same head as one that ran through
    whole = train(TrainConfig(steps=6, **dict(base, out=str(tmp_path / "whole"))))
    assert [h["loss"] for h in whole["history"]] == [h["loss"] for h in rep["history"]]
    a, b = (load_file(tmp_path / d / "head" / "model.safetensors") for d in ("o", "whole"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    trained = torch.load(tmp_path / "o" / "checkpoint.pt")["train_seconds"]
    assert rep["train_seconds"] >= trained > 0
    # the same run with more steps but a budget already spent: stops at once instead of training on
    again = train(TrainConfig(steps=12, time_limit=trained / 2, **base))
    assert again["steps_done"] == 6 and again["history"][-1]["step"] == 5
    with pytest.raises(ValueError, match="stop-after"):
        TrainConfig(stop_after=-1, **dict(base, steps=1))



@pytest.mark.parametrize("method", ["eagle3", "mtp"])
def test_bfloat16_target_features_train_the_float32_head(dirs, method):
    """--target-dtype bfloat16: the target runs in bf16 and the head's matmuls under autocast, while the
    head's weights (and so its gradients and optimizer state) stay float32; the loss stays close to float32's."""
    from specserve.loaders import load_model

    g = torch.Generator().manual_seed(5)
    data = [{"prompt_ids": torch.randint(0, 100, (6,), generator=g).tolist(),
             "response_ids": torch.randint(0, 100, (10,), generator=g).tolist()} for _ in range(3)]
    tokens, lengths, starts = make_batch(data, [0, 1, 2], 16, "cpu")
    losses = {}
    for dtype in (torch.float32, torch.bfloat16):
        target = load_model(str(dirs / "target"), dtype, "cpu").model
        cfg = TrainConfig(target=None, method=method, prompts=["x"], out="unused")
        head = build_head(cfg, target, data)
        hidden, aux = target_features(target, head, tokens)
        assert hidden.dtype == dtype
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            loss, _, _ = ttt_loss(cfg, head, tokens, lengths, starts, hidden, aux)
        loss.backward()
        grads = [p.grad for p in head.parameters() if p.requires_grad]
        assert grads and all(gr is not None and gr.dtype == torch.float32 and gr.abs().sum() > 0 for gr in grads)
        losses[dtype] = loss.item()
    assert losses[torch.bfloat16] == pytest.approx(losses[torch.float32], rel=0.03)


def test_resume_with_options_that_would_not_apply_is_refused(dirs, tmp_path):
    """The cached data and the checkpoint fix what a resumed run trains on and what it trains: options that
    change them are refused (and the run's recorded options kept); steps and time limits may change."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Say {i}."}) + "\n" for i in range(4)))
    base = dict(target=str(dirs / "target"), prompts=[str(prompts)], out=str(tmp_path / "o"),
                device="cpu", gen_max_tokens=4, batch_size=2, steps=2, eval_max_tokens=2)
    train(TrainConfig(stop_after=0.0, method="eagle3", aux_layers=(1, 3, 6), **base))
    for bad, flag in ((dict(method="eagle3", aux_layers=(0, 3, 6)), "--aux-layers"),
                      (dict(method="mtp"), "--method"),
                      (dict(method="eagle3", aux_layers=(1, 3, 6), gen_temperature=0.9), "--gen-temperature")):
        with pytest.raises(ValueError, match=f"{flag} .*resume with the same options"):
            train(TrainConfig(**bad, **base))
    assert json.loads((tmp_path / "o" / "train_config.json").read_text())["method"] == "eagle3"
    rep = train(TrainConfig(method="eagle3", aux_layers=(1, 3, 6), time_limit=60.0, **base))
    assert rep["steps_done"] == 2


def test_a_missing_eval_file_or_a_file_as_out_fails_before_anything_runs(dirs, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "Say hi."}) + "\n")
    base = dict(target=str(dirs / "target"), method="mtp", prompts=[str(prompts)], device="cpu")
    with pytest.raises(ValueError, match="typo.jsonl' not found"):
        train(TrainConfig(out=str(tmp_path / "o"), eval_prompts=[str(tmp_path / "typo.jsonl")], **base))
    assert not (tmp_path / "o").exists()
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="is a file"):
        train(TrainConfig(out=str(tmp_path / "file"), **base))



def test_synthesized_prompts_join_training_and_data_files_combine_without_held_out_overlap(dirs, tmp_path):
    """The target writes user messages from its chat template up to a user turn; the kept ones (ended by the
    target, unique, not held out) are trained on, listed in data.pt, and that file combines with data of the
    prompt files' split only when none of its prompts is held out there."""
    from specserve.tokenizer import Tokenizer
    from specserve.train.generate import end_of_turn_ids, pre_query_ids, synthesize_prompts

    tok = Tokenizer.from_folder(dirs / "target")
    pre = pre_query_ids(tok)
    assert tok.decode(end_of_turn_ids(tok), skip_special_tokens=False) == "<|im_end|>"
    assert tok.apply_chat_template([{"role": "user", "content": "hello"}])[:len(pre)] == pre
    assert tok.decode(pre, skip_special_tokens=False).endswith("<|im_start|>user\n")

    base = dict(target=str(dirs / "target"), method="eagle3", device="cpu", synthetic_temperature=5.0,
                synthetic_max_tokens=96, gen_max_tokens=4)
    cfg = TrainConfig(prompts=[], out="unused", synthetic_prompts=24, **base)
    texts = synthesize_prompts(cfg, set())
    assert 0 < len(texts) < 24 and len(set(texts)) == len(texts) and all(t == t.strip() and t for t in texts)
    assert synthesize_prompts(cfg, {texts[0] + "  "}) == texts[1:]  # held-out prompts are never kept
    opened = synthesize_prompts(TrainConfig(prompts=[], out="unused", synthetic_prompts=24,
                                            synthetic_openers=["Write", "Tell me"], **base), set())
    assert opened and all(t.startswith(("Write", "Tell me")) for t in opened)
    assert any(t.startswith("Tell me") for t in opened) and any(t.startswith("Write") for t in opened)
    with pytest.raises(ValueError, match="needs --synthetic-prompts"):
        TrainConfig(prompts=["p"], out="unused", synthetic_openers=["Write"], **base)
    with pytest.raises(ValueError, match="whitespace"):
        TrainConfig(prompts=[], out="unused", synthetic_prompts=2, synthetic_openers=["Tell me "], **base)

    rep = train(TrainConfig(prompts=[], out=str(tmp_path / "syn"), synthetic_prompts=24, regenerate_only=True, **base))
    assert rep["regenerated"] == len(texts)
    syn = torch.load(tmp_path / "syn" / "data.pt")
    assert syn["train_prompts"] == texts and syn["holdout_prompts"] == []

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in [f"Say {i}." for i in range(5)] + texts[:1]))
    files = {}
    for seed in range(40):  # a split that holds out texts[0], and one that trains on it
        out = tmp_path / f"files{seed}"
        train(TrainConfig(prompts=[str(prompts)], out=str(out), seed=seed, holdout=0.2, regenerate_only=True,
                          **dict(base, synthetic_prompts=0)))
        files[texts[0] in torch.load(out / "data.pt")["holdout_prompts"]] = str(out / "data.pt")
        if len(files) == 2:
            break
    common = dict(target=str(dirs / "target"), method="eagle3", prompts=[], device="cpu", steps=1, batch_size=2,
                  eval_max_prompts=1, eval_max_tokens=2)
    rep = train(TrainConfig(out=str(tmp_path / "ok"), data=[files[False], str(tmp_path / "syn" / "data.pt")],
                            **common))
    assert rep["train_sequences"] == 5 + len(texts)  # six prompts, one held out
    with pytest.raises(ValueError, match="trained on 1 prompt"):
        train(TrainConfig(out=str(tmp_path / "bad"), data=[files[True], str(tmp_path / "syn" / "data.pt")], **common))


def test_generation_workers_that_do_not_fit_the_gpu_say_to_use_fewer(monkeypatch):
    """Each of n --gen-workers engines may use 1/n of 80% of the GPU; an engine that finds no room says so in
    train-draft's terms (the share's own error stands alone for one worker)."""
    import types

    import specserve
    from specserve.train import generate

    def no_room(*args, **kwargs):
        raise ValueError(f"--gpu-memory-utilization {kwargs['gpu_memory_utilization']} leaves no room")

    monkeypatch.setattr(specserve, "LLM", no_room)
    cfg = types.SimpleNamespace(target="t", gen_dtype="auto", device="cuda")
    with pytest.raises(ValueError, match=r"0.1 leaves no room \(train-draft: each of the 8 --gen-workers .*fewer"):
        generate._shard(cfg, [], 0, 8, generate.RESPOND)
    with pytest.raises(ValueError, match=r"^--gpu-memory-utilization 0.8 leaves no room$"):
        generate._shard(cfg, [], 0, 1, generate.RESPOND)


def test_development_sets_use_only_records_never_trained_on(tmp_path):
    """Categories from the file's name and from its records' responses (documents of sections, conversations,
    texts to rewrite, extract from or translate), math from templates; a record outside ``allowed`` appears
    nowhere; the same seed gives the same sets."""
    from specserve.train.devsets import CHARS_PER_TOKEN, TEXT_CATEGORIES, build_dev_sets

    recs = [{"instruction": f"Task {i}: describe the harbour.", "input": "",
             "response": f"MARK{i:03d} " + "The harbour is busy at dawn. Boats leave for the sea. " * 8}
            for i in range(40)]
    f = tmp_path / "gpteacher-roleplay-instruct.json"
    f.write_text(json.dumps(recs))
    allowed = {r["instruction"] for r in recs[::2]}
    sets = build_dev_sets([f], allowed, per_category=4, seed=3, doc_tokens=(300, 600))
    assert set(sets) == {"chat", "math", *TEXT_CATEGORIES}
    assert all(len(v) == 4 and v[-1][-1]["role"] == "user" for v in sets.values())
    assert all(c[0]["content"] in allowed for c in sets["chat"])
    text = json.dumps(sets)
    assert all(f"MARK{i:03d}" not in text for i in range(1, 40, 2))  # no held-in record's response
    assert sum(f"MARK{i:03d}" in text for i in range(0, 40, 2)) > 5
    for conv in sets["summarization"] + sets["document-qa"]:  # within a section (~450 characters) of its length
        assert 300 * CHARS_PER_TOKEN - 500 <= len(conv[0]["content"]) <= 600 * CHARS_PER_TOKEN + 500
    assert all(len(c) >= 5 and c[1]["role"] == "assistant" for c in sets["multi-turn"])
    assert build_dev_sets([f], allowed, 4, seed=3, doc_tokens=(300, 600)) == sets
    assert build_dev_sets([f], allowed, 4, seed=4, doc_tokens=(300, 600)) != sets
    # training's conversations (--category-prompts): no as-is category, math from the other templates
    train_sets = build_dev_sets([f], allowed, 8, seed=3, doc_tokens=(300, 600), development=False)
    assert "chat" not in train_sets and len(train_sets["math"]) == 8
    kinds = [{c[0]["content"][:25] for c in v["math"]} for v in (sets, train_sets)]
    assert not kinds[0] & kinds[1]


def test_development_sets_take_every_evaluation_prompt_and_no_trained_one(tmp_path, monkeypatch):
    """--eval-max-prompts cuts the evaluation sets, not the records the development sets are made of; a prompt
    that training used is never a development record, even in an evaluation file."""
    from types import SimpleNamespace

    from specserve.train import report

    f = tmp_path / "alpaca-seed-tasks.jsonl"
    f.write_text("".join(json.dumps({"instruction": f"Task {i}."}) + "\n" for i in range(10)))
    monkeypatch.setattr(report, "acceptance", lambda target, method, head, ps, *a: ps)
    cfg = SimpleNamespace(eval_max_prompts=2, eval_prompts=[str(f)], prompts=[], dev_set_size=20, seed=0,
                          doc_tokens=400, target=None, method="eagle3", eval_draft_len=4, eval_max_tokens=8, device=None)
    sets = report.evaluate(cfg, tmp_path, ["Held out."], trained=["Task 3.", [{"role": "user", "content": "x"}]])
    assert len(sets[f.name]) == 2
    dev = sorted(c[0]["content"] for c in sets["dev/instructions"])
    assert dev == sorted(f"Task {i}." for i in range(10) if i != 3)


def test_category_prompts_join_training_as_conversations_the_target_answers(dirs, tmp_path):
    """--category-prompts: documents, conversations and texts made of the training records' responses (never the
    held-out ones), answered by the target; their counts are recorded with the data; a resume with another count
    is refused; documents must fit --max-seq-len."""
    recs = [{"instruction": f"Task {i}: describe the harbour.", "input": "",
             "response": f"MARK{i:03d} " + "The harbour is busy at dawn. Boats leave. " * 6} for i in range(20)]
    f = tmp_path / "gpteacher-roleplay-instruct.json"
    f.write_text(json.dumps(recs))
    base = dict(target=str(dirs / "target"), method="eagle3", prompts=[str(f)], out=str(tmp_path / "o"),
                device="cpu", gen_max_tokens=4, holdout=0.25, doc_tokens=80, max_seq_len=200, regenerate_only=True)
    train(TrainConfig(category_prompts=2, **base))
    data = torch.load(tmp_path / "o" / "data.pt")
    train(TrainConfig(category_prompts=1, synthetic_prompts=3, synthetic_max_tokens=8,
                      **dict(base, out=str(tmp_path / "both"))))  # synthesized prompts join them, not replace them
    both = torch.load(tmp_path / "both" / "data.pt")["train_prompts"]
    assert sum(isinstance(p, list) for p in both) == 7
    assert json.loads((tmp_path / "both" / "prompts_split.json").read_text())["synthetic_asked"] == 3
    convs = [p for p in data["train_prompts"] if isinstance(p, list)]
    assert data["category_prompts"] == {"summarization": 2, "document-qa": 2, "multi-turn": 2, "rewriting": 2,
                                        "extraction": 2, "translation": 2, "math": 2}
    assert len(convs) == 14
    held = {int(h.split()[1][:-1]) for h in data["holdout_prompts"]}
    assert len(held) == 5 and not any(f"MARK{i:03d}" in json.dumps(convs) for i in held)
    # every conversation that fits the tiny model's 512 positions (its text is about a token a character: the
    # documents and multi-turn ones do not) is answered, its prompt the conversation through the chat template
    tok = LLM(str(dirs / "target"), device="cpu", dtype="float32").tokenizer
    answered = {tuple(s["prompt_ids"]) for s in data["train"] if s["response_ids"]}
    short = [c for c in convs if len(tok.apply_chat_template(c)) < 500]
    assert len(short) >= 8 and all(tuple(tok.apply_chat_template(c)) in answered for c in short)
    with pytest.raises(ValueError, match="--category-prompts .*resume with the same options"):
        train(TrainConfig(category_prompts=3, **base))
    with pytest.raises(ValueError, match="give --max-seq-len at least 84"):
        TrainConfig(category_prompts=2, **dict(base, max_seq_len=60))


def test_a_token_budget_takes_fewer_long_sequences_a_batch():
    import random

    from specserve.train.data import sample_batch

    seqs = [{"prompt_ids": [1] * n, "response_ids": [2] * 4} for n in (4, 400, 12, 1000)]
    a, b = random.Random(5), random.Random(5)
    assert sample_batch(a, seqs, 6, 0, 512) == [b.randrange(4) for _ in range(6)]  # no budget: as before
    for seed in range(20):
        idx = sample_batch(random.Random(seed), seqs, 6, 1024, 512)
        longest = max(min(512, len(seqs[i]["prompt_ids"]) + 4) for i in idx)
        assert 1 <= len(idx) <= 6 and (len(idx) == 1 or len(idx) * longest <= 1024)
