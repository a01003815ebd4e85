"""Training from an exported head (``--init-from``): its weights carry over, mismatches are refused before any
regeneration, and ``--steps 0`` with ``--draft-vocab N --draft-vocab-shared`` restricts a head to the target's
lm_head rows at the N most frequent response tokens."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.train.trainer import TrainConfig, build_head, train
from tiny_models import make_head, make_train_dirs


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return make_train_dirs(tmp_path_factory.mktemp("train-init"))


def test_init_from_starts_at_an_exported_heads_weights(dirs, tmp_path):
    from specserve.loaders import load_model
    from specserve.train.trainer import init_from_head

    target = load_model(str(dirs / "target"), torch.float32, "cpu").model
    cfg = TrainConfig(target=None, method="eagle3", prompts=["x"], out="unused", init_from=str(dirs / "eagle3"),
                      aux_layers=(0, 3, 4))
    data = [{"prompt_ids": [1, 2], "response_ids": [3]}]
    head = build_head(cfg, target, data)
    with pytest.raises(ValueError, match="same --aux-layers"):
        init_from_head(head, cfg, target, "cpu")
    cfg.aux_layers = None
    head = build_head(cfg, target, data)
    init_from_head(head, cfg, target, "cpu")
    shipped = LLM(str(dirs / "target"), device="cpu", dtype="float32", speculative_config=dict(
        method="eagle3", draft_model=str(dirs / "eagle3"), max_draft_len=2)).engine.head
    assert torch.equal(head.fc.weight, shipped.fc.weight.float()) and head.fc.weight.requires_grad
    # the same mismatches, found from config.json before any regeneration
    from specserve.loaders import load_config
    from specserve.train.trainer import check_init_from

    tcfg = load_config(str(dirs / "target"))
    check_init_from(cfg, tcfg)
    for over, msg in ((dict(aux_layers=(0, 3, 4)), "same --aux-layers"), (dict(draft_vocab=50), "--draft-vocab 0"),
                      (dict(method="mtp"), "not an mtp head")):
        with pytest.raises(ValueError, match=msg):
            check_init_from(TrainConfig(**{**dict(target=None, method="eagle3", prompts=["x"], out="unused",
                                                  init_from=str(dirs / "eagle3")), **over}), tcfg)
    with pytest.raises(ValueError, match="not a head folder"):
        TrainConfig(target=None, method="eagle3", prompts=["x"], out="o", init_from=str(tmp_path / "none"))


def test_a_head_restricted_to_a_draft_vocabulary_of_the_targets_rows_exports_loads_and_stays_lossless(dirs, tmp_path):
    """--init-from HEAD --draft-vocab N --draft-vocab-shared --steps 0: the head keeps its weights and drafts over
    the target's lm_head rows at the N most frequent tokens of the regenerated responses (no own lm_head)."""
    from safetensors import safe_open

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Tell me about the number {i}."}) + "\n" for i in range(12)))
    rep = train(TrainConfig(target=str(dirs / "target"), method="eagle3", prompts=[str(prompts)],
                            out=str(tmp_path / "r"), device="cpu", steps=0, init_from=str(dirs / "eagle3"),
                            draft_vocab=40, draft_vocab_shared=True, gen_max_tokens=24, eval_max_tokens=12,
                            export_dtype="float32"))
    head_dir = tmp_path / "r" / "head"
    cfg = json.loads((head_dir / "config.json").read_text())
    assert cfg["draft_vocab_size"] == 40 and cfg["specserve_training"]["init_from"] == str(dirs / "eagle3")
    with safe_open(str(head_dir / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in f.keys()
        d2t, t2d = f.get_tensor("d2t"), f.get_tensor("t2d")
    ids = torch.arange(40) + d2t
    counts = torch.zeros(cfg["vocab_size"], dtype=torch.int64)
    for d in torch.load(tmp_path / "r" / "data.pt")["train"]:
        counts += torch.bincount(torch.tensor(d["response_ids"]), minlength=cfg["vocab_size"])
    assert counts[ids].min() >= counts[~t2d].max() and t2d.sum() == 40 and t2d[ids].all()
    assert len(rep["eval"]["holdout"]["per_position_acceptance"]) == 4
    kw = dict(device="cpu", dtype="float32")
    spec = LLM(str(dirs / "target"), **kw, speculative_config=dict(method="eagle3", draft_model=str(head_dir),
                                                                   max_draft_len=3))
    src = LLM(str(dirs / "target"), **kw, speculative_config=dict(method="eagle3", draft_model=str(dirs / "eagle3"),
                                                                  max_draft_len=3)).engine.head
    head = spec.engine.head
    assert head.lm_head is None and torch.equal(head.fc.weight, src.fc.weight)
    assert torch.equal(head.lm_weight(), spec.engine.model.lm_weight()[ids])
    x = torch.randn(3, cfg["hidden_size"])
    assert torch.equal(head.draft_ids(0, x), ids[head.raw_logits(0, x).argmax(-1)])
    plain = LLM(str(dirs / "target"), **kw)
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts_ = ["Hello world", "Tell me about the number 3."]
    assert [o.token_ids for o in spec.generate(prompts_, sp)] == [o.token_ids for o in plain.generate(prompts_, sp)]
    assert spec.engine.spec_stats.num_drafted > 0


def test_init_from_an_mtp_head_and_own_or_shared_output_layers(dirs, tmp_path):
    """MTP heads start from an exported one too (they have no draft vocabulary); an EAGLE-3 head with a draft
    vocabulary starts only from one whose output layer is the same kind (own lm_head, or the target's rows)."""
    from specserve.loaders import load_config, load_model
    from specserve.train.trainer import check_init_from, init_from_head

    target = load_model(str(dirs / "target"), torch.float32, "cpu").model
    make_head(tmp_path / "mtp", dirs / "target", "mtp", own_head=False, seed=2)  # as train-draft exports them
    cfg = TrainConfig(target=None, method="mtp", prompts=["x"], out="unused", init_from=str(tmp_path / "mtp"))
    head = build_head(cfg, target, [{"prompt_ids": [1, 2], "response_ids": [3]}])
    init_from_head(head, cfg, target, "cpu")
    src = LLM(str(dirs / "target"), device="cpu", dtype="float32", speculative_config=dict(
        method="mtp", draft_model=str(tmp_path / "mtp"), max_draft_len=2)).engine.head
    assert torch.equal(head.modules_[0].eh_proj.weight, src.modules_[0].eh_proj.weight.float())
    tcfg = load_config(str(dirs / "target"))
    make_head(tmp_path / "own", dirs / "target", "eagle3", draft_vocab=50, seed=3)
    make_head(tmp_path / "rows", dirs / "target", "eagle3", draft_vocab=50, own_head=False, seed=3)
    for folder, shared, msg in (("own", True, "leave out --draft-vocab-shared"), ("rows", False, "give --draft-vocab-shared")):
        bad = TrainConfig(target=None, method="eagle3", prompts=["x"], out="unused", init_from=str(tmp_path / folder),
                          draft_vocab=50, draft_vocab_shared=shared)
        with pytest.raises(ValueError, match=msg):
            check_init_from(bad, tcfg)
        check_init_from(dataclasses.replace(bad, draft_vocab_shared=not shared), tcfg)
