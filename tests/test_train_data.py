"""Draft-head training data: prompt files in common shapes, regenerated data files combined without training on
another's held-out prompts, synthesized prompts, conversations by category for training and development sets
(``train/devsets.py``), and batches under a token budget."""

from __future__ import annotations

import gzip
import json

import pytest
import torch

from specserve import LLM
from specserve.train.prompts import read_prompts
from specserve.train.trainer import TrainConfig, train
from tiny_models import make_train_dirs


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return make_train_dirs(tmp_path_factory.mktemp("train-data"))


def _write(path, obj):
    path.write_text(json.dumps(obj))
    return path


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
