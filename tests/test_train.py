"""Draft-head training: training-time test matches the inference draft loop; a short run lowers the loss and
exports a head that loads and drafts. Its data: test_train_data.py; starting from exported heads:
test_train_init.py."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from specserve import LLM, SamplingParams
from specserve.train.attention import DenseCausal, TrainingTimeTest
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


def test_one_engine_evaluates_each_set_as_a_fresh_engine_would(dirs):
    """The report's sets share one engine; each set's figures equal what an engine of its own counts for it."""
    from specserve.train.report import acceptance

    sets = {"a": ["Hello world", "The fox"], "b": [[{"role": "user", "content": "Count to five"},
                                                   {"role": "assistant", "content": "1 2 3"},
                                                   {"role": "user", "content": "Go on"}]]}
    target, head = str(dirs / "target"), str(dirs / "eagle3")
    got = acceptance(target, "eagle3", head, sets, draft_len=3, max_tokens=12, device="cpu", dtype="float32")
    for name, prompts in sets.items():
        llm = LLM(target, device="cpu", dtype="float32",
                  speculative_config=dict(method="eagle3", draft_model=head, max_draft_len=3))
        convs = [[{"role": "user", "content": p}] if isinstance(p, str) else p for p in prompts]
        llm.generate([{"prompt_token_ids": llm.tokenizer.apply_chat_template(c)} for c in convs],
                     SamplingParams(temperature=0, max_tokens=12))
        ref = llm.engine.spec_stats
        assert ref.num_drafted > 0
        assert got[name]["prompts"] == len(prompts)
        # the counts, not only their ratios: this random head accepts nothing, so ratios alone match anything
        assert (got[name]["drafted"], got[name]["accepted"], got[name]["verify_steps"], got[name]["emitted"]) == \
            (ref.num_drafted, ref.num_accepted, ref.num_verify_steps, ref.num_emitted)
        assert got[name]["per_position_acceptance"] == ref.per_position
    assert got["a"]["drafted"] != got["b"]["drafted"]  # the sets differ: a total over both would not match


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
