"""``specserve bench`` on tiny models (CPU): rows for every configuration, percentiles, ratios, and the three
output files; prompt sources (files, random lengths); clear errors."""

from __future__ import annotations

import json
import time

import pytest

from specserve.bench.report import table
from specserve.bench.run import BenchConfig, run_bench, tree_config
from specserve.cli import main
from tiny_models import make_head, make_hf_model


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench")
    make_hf_model(root / "target", "llama", num_hidden_layers=2)
    make_head(root / "eagle3", root / "target", "eagle3", own_head=False, seed=1)
    return root


def test_bench_rows_ratios_and_outputs(dirs, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"turns": [f"Question {i}?", "follow-up"]}) + "\n" for i in range(5)))
    out = tmp_path / "out"
    rc = main(["bench", "--model", str(dirs / "target"), "--prompts", str(prompts), "--batch-size", "1", "3",
               "--max-tokens", "6", "--repeats", "2", "--draft", str(dirs / "eagle3"), "--draft-len", "2",
               "--compare", "hf", "--device", "cpu", "--dtype", "float32", "--out", str(out)])
    assert rc == 0
    res = json.loads((out / "bench.json").read_text())
    assert (out / "bench.png").stat().st_size > 0 and "| specserve | on | on | on (0%) | 3 |" in (out / "bench.md").read_text()
    rows = {(r["engine"], r["speculative"], r["batch"]): r for r in res["rows"]}
    assert set(rows) == {(e, s, b) for e, s in (("specserve", False), ("specserve", True), ("transformers", False))
                         for b in (1, 3)}
    for r in rows.values():
        assert r["tokens_per_s"] > 0 and len(r["all_seconds"]) == 2 and r["requests"] == 5
        assert r["seconds"] == min(r["all_seconds"])  # of two runs the faster (a host's pause only slows a run)
    # every prompt runs at every batch size, at most `batch` in flight: batch 1 takes a step per token
    assert rows[("specserve", False, 1)]["steps"] >= 5 * 6
    assert rows[("specserve", False, 3)]["steps"] < 5 * 6
    spec = rows[("specserve", True, 3)]
    assert 1.0 <= spec["acceptance_length"] <= 3.0 and len(spec["per_position_acceptance"]) == 2
    assert spec["ttft_ms"]["p50"] <= spec["ttft_ms"]["p99"]
    # TTFT counts from admission, not from the common submission: at batch 1 the fifth request waits for four
    # whole requests first, which its TTFT must not include (one request takes about a fifth of the run)
    b1 = rows[("specserve", False, 1)]
    assert b1["ttft_ms"]["p99"] < 0.5 * b1["seconds"] * 1e3
    # greedy: speculation, plain decoding and transformers agree on the first tokens
    assert rows[("specserve", True, 1)]["first_tokens"] == rows[("specserve", False, 1)]["first_tokens"] \
        == rows[("transformers", False, 1)]["first_tokens"]
    assert "specserve / transformers @ batch 3" in res["ratios"]
    # both engines stop at the same place (max tokens or end of sequence) and count the same tokens
    assert rows[("specserve", False, 3)]["new_tokens"] == rows[("transformers", False, 3)]["new_tokens"]


def test_bench_rounds_alternate_the_engines_and_report_the_median_round(dirs):
    res = run_bench(BenchConfig(model=str(dirs / "target"), draft=str(dirs / "eagle3"), draft_len=2, num_prompts=2,
                                max_tokens=4, repeats=1, rounds=3, device="cpu", dtype="float32"))
    rows = {r["speculative"]: r for r in res["rows"]}
    assert len(res["rows"]) == 2 and set(rows) == {False, True}
    for r in rows.values():
        each = r["round_tokens_per_s"]
        assert len(each) == 3 and r["tokens_per_s"] == sorted(each)[1]  # the median round
    per_round = sorted(s / p for s, p in zip(rows[True]["round_tokens_per_s"], rows[False]["round_tokens_per_s"]))
    assert res["ratios"]["specserve+spec / specserve @ batch 1, median of 3 rounds"] == per_round[1]
    medians = rows[True]["tokens_per_s"] / rows[False]["tokens_per_s"]
    assert res["ratios"]["specserve+spec / specserve @ batch 1"] == medians
    with pytest.raises(ValueError, match="--rounds"):
        BenchConfig(rounds=0)


def test_interleaved_engines_run_side_by_side_and_report_as_alone(dirs, tmp_path, monkeypatch):
    """--interleave: every engine's warm-up at a batch size, then the timed runs in turn; the rows are those of
    engines run one after the other (greedy tokens, requests, runs), engine by engine."""
    import specserve.bench.engine_run as bench_run

    order, shares, real = [], set(), bench_run.EngineRun.run

    def spy(self, b, timed=True, note=""):
        order.append((self.kind, b, timed))
        shares.add(self.eng.cache_config.gpu_memory_utilization)
        return real(self, b, timed, note)

    monkeypatch.setattr(bench_run.EngineRun, "run", spy)
    kinds = [False, True, "chain D=1"]
    assert main(["bench", "--model", str(dirs / "target"), "--draft", str(dirs / "eagle3"), "--draft-len", "2",
                 "--fixed-draft-lens", "1", "--num-prompts", "3", "--max-tokens", "5", "--batch-size", "1", "2",
                 "--repeats", "2", "--interleave", "--device", "cpu", "--dtype", "float32",
                 "--out", str(tmp_path)]) == 0
    side = json.loads((tmp_path / "bench.json").read_text())
    assert len(shares) == 1 and shares.pop() == pytest.approx(0.9 / 3)  # engines held together split the share
    shares.clear()
    assert order == [x for b in (1, 2) for x in [(k, b, False) for k in kinds] +
                     [(k, b, True) for _ in range(2) for k in kinds]]
    order.clear()
    alone = run_bench(BenchConfig(model=str(dirs / "target"), draft=str(dirs / "eagle3"), draft_len=2,
                                  fixed_draft_lens=[1], num_prompts=3, max_tokens=5, batch_sizes=[1, 2], repeats=2,
                                  device="cpu", dtype="float32"))
    assert order == [(k, b, t) for k in kinds for b in (1, 2) for t in (False, True, True)]
    assert shares == {0.9}

    def key(r):
        return r["speculative"], r["batch"], r["requests"], r["first_tokens"], len(r["all_seconds"])
    assert [key(r) for r in side["rows"]] == [key(r) for r in alone["rows"]]
    assert len(side["rows"]) == 6


def test_bench_reports_graphs_captured_during_timed_runs(dirs, monkeypatch):
    """A graph captured inside a timed run (one the warm-up did not meet) is in that run's time: the row counts
    them and the table says so; a run without captures says nothing."""
    import itertools

    from specserve.bench import engine_run as bench_run

    cfg = dict(model=str(dirs / "target"), speculative="off", num_prompts=2, max_tokens=3, repeats=2, device="cpu",
               dtype="float32")
    quiet = run_bench(BenchConfig(**cfg))
    assert quiet["rows"][0]["timed_captures"] == 0 and "captured during timed runs" not in table(quiet)
    looks = itertools.count()
    monkeypatch.setattr(bench_run, "_captured", lambda eng: next(looks))  # one graph more at every look
    res = run_bench(BenchConfig(**cfg))
    assert res["rows"][0]["timed_captures"] == 2  # one in each of the two timed runs, none counted for the warm-up
    assert "CUDA graphs captured during timed runs" in table(res) and "specserve off batch 1: 2" in table(res)


def test_bench_overlap_both_runs_each_engine_with_and_without_it(dirs):
    res = run_bench(BenchConfig(model=str(dirs / "target"), speculative="off", overlap="both", num_prompts=2,
                                max_tokens=4, repeats=1, rounds=2, device="cpu", dtype="float32"))
    rows = {r["overlap"]: r for r in res["rows"]}
    assert len(res["rows"]) == 2 and set(rows) == {False, True}
    assert rows[True]["first_tokens"] == rows[False]["first_tokens"]
    per_round = [a / b for a, b in zip(rows[True]["round_tokens_per_s"], rows[False]["round_tokens_per_s"])]
    assert res["ratios"]["specserve overlap on / off @ batch 1, median of 2 rounds"] == pytest.approx(
        sum(per_round) / 2)
    with pytest.raises(ValueError, match="--overlap"):
        BenchConfig(overlap="sometimes")


def test_bench_runs_draft_trees_beside_the_chain(dirs):
    res = run_bench(BenchConfig(model=str(dirs / "target"), draft=str(dirs / "eagle3"), draft_len=2, num_prompts=3,
                                max_tokens=6, repeats=1, device="cpu", dtype="float32",
                                trees=["2x2x4", "3x3x9", "3x3x9:1"], batch_sizes=[1, 2]))
    kinds = {(r["speculative"], r["batch"]): r for r in res["rows"]}
    assert set(kinds) == {(k, b) for k in (False, True, "tree 2x2x4", "tree 3x3x9", "tree 3x3x9:1") for b in (1, 2)}
    # tree_max_batch_size 1: two rows draft chains (3 drafts), the third prompt alone the tree (9): the table lists both
    mixed = kinds[("tree 3x3x9:1", 2)]["steps_by_draft_len"]
    assert mixed[3] > 0 and mixed[9] > 0
    assert "| specserve | tree 3x3x9:1 | on | 2 | 3: " in table(res)
    assert "| steps by drafts proposed a row: engine |" in table(res)
    tree = kinds[("tree 3x3x9", 2)]
    assert tree["draft_len"] == 3 and tree["acceptance_length"] >= 1.0
    assert tree["first_tokens"] == kinds[(False, 2)]["first_tokens"]  # greedy: lossless
    assert "specserve+tree 3x3x9 / specserve+spec @ batch 2" in res["ratios"]
    assert "specserve+tree 2x2x4 / specserve @ batch 1" in res["ratios"]
    assert "| tree 2x2x4 |" in table(res)
    with pytest.raises(ValueError, match="--tree"):
        BenchConfig(trees=["2x4"])
    with pytest.raises(ValueError, match="--tree"):
        BenchConfig(trees=["2x2x4:all"])
    assert tree_config("4x6x24") == dict(topk=4, max_draft_len=6, max_total_draft_tokens=24)
    assert tree_config("4x6x24:64") == dict(topk=4, max_draft_len=6, max_total_draft_tokens=24,
                                            tree_max_batch_size=64)


def test_bench_shared_prefix_with_prefix_caching_on_and_off(dirs):
    res = run_bench(BenchConfig(model=str(dirs / "target"), speculative="off", prefix_caching="both",
                                shared_prefix_len=40, random_input_len=6, num_prompts=4, max_tokens=3, repeats=1,
                                device="cpu", dtype="float32", batch_sizes=[1]))
    rows = {r["prefix_caching"]: r for r in res["rows"]}
    assert set(rows) == {True, False} and rows[True]["first_tokens"] == rows[False]["first_tokens"]
    # four prompts over one 40-token prefix (two full blocks and 8 more): the last three find both blocks
    assert rows[True]["prefix_hit_rate"] == pytest.approx(6 / 8) and rows[False]["prefix_hit_rate"] is None
    assert "specserve prefix caching on / off @ batch 1" in res["ratios"]
    with pytest.raises(ValueError, match="--prefix-caching"):
        BenchConfig(prefix_caching="maybe")


def test_bench_multi_turn_conversations_reuse_their_history(dirs):
    """Three turns of four conversations: each later turn resends the history (prompt, replies, new user tokens),
    which prefix caching finds; outputs are the same with it off."""
    cfg = dict(model=str(dirs / "target"), speculative="off", prefix_caching="both", random_input_len=20,
               num_prompts=4, max_tokens=9, repeats=1, device="cpu", dtype="float32", batch_sizes=[2], turns=3,
               turn_len=5)
    res = run_bench(BenchConfig(**cfg))
    rows = {r["prefix_caching"]: r for r in res["rows"]}
    assert rows[True]["requests"] == 12 and rows[True]["turns"] == 3
    assert rows[True]["first_tokens"] == rows[False]["first_tokens"]
    # blocks of 16, a block looked up only if a token is left after it: turn 1 looks up 1 block of 20 tokens and
    # finds none; turn 2 resends 20 + 9 + 5 = 34 tokens, looks up 2, finds the 1 full block turn 1 computed (28
    # tokens); turn 3 resends 48, looks up 2 and finds both (turn 2 computed 42): 12 of 20 lookups over 4 chats
    assert rows[True]["prefix_hit_rate"] == pytest.approx(12 / 20)
    with pytest.raises(ValueError, match="--turns"):
        BenchConfig(turns=0)


def test_two_rounds_report_the_mean_of_their_ratios():
    """Of an even number of rounds the ratio is the mean of the middle two, not the better one; each row stays
    a real round (the faster middle one)."""
    from specserve.bench.summary import median_rounds, ratios

    rows = [dict(engine="specserve", speculative=spec, batch=1, tokens_per_s=tps)
            for spec, tps in ((False, 1846.5), (True, 4302.5), (False, 1824.0), (True, 4189.1))]
    med = median_rounds(rows)
    assert sorted(r["tokens_per_s"] for r in med) == [1846.5, 4302.5]
    ratio = ratios(med)["specserve+spec / specserve @ batch 1, median of 2 rounds"]
    assert ratio == pytest.approx((4302.5 / 1846.5 + 4189.1 / 1824.0) / 2)


def test_generated_count_stops_each_row_at_its_first_end_of_sequence():
    import torch

    from specserve.bench.hf import generated_count

    new = torch.tensor([[5, 2, 0, 0], [5, 6, 7, 8], [2, 2, 9, 0]])
    assert generated_count(new, (2,)) == 2 + 4 + 1
    assert generated_count(new, (7, 9)) == 4 + 3 + 3
    assert generated_count(new, ()) == 12


def test_bench_random_prompts_and_random_model():
    res = run_bench(BenchConfig(model="random:smollm2-135m", batch_sizes=[2], max_tokens=4, repeats=1,
                                ignore_eos=True, speculative="on", draft="random", forced_acceptance=1.5, num_prompts=2,
                                device="cpu", dtype="float32"))
    (row,) = res["rows"]
    assert row["speculative"] and row["new_tokens"] == 4
    assert res["meta"]["config"]["random_input_len"] == 128  # random models default to random prompts


def test_bench_errors(dirs):
    with pytest.raises(ValueError, match="--compare"):
        BenchConfig(compare=["vllm"])
    with pytest.raises(ValueError, match="--draft"):
        run_bench(BenchConfig(model=str(dirs / "target"), speculative="on", device="cpu", max_tokens=3))
    assert main(["bench", "--model", "random:nope", "--device", "cpu"]) == 2
    t0 = time.perf_counter()  # --steps needs CUDA graphs: refused before any benchmark runs
    assert main(["bench", "--model", str(dirs / "target"), "--device", "cpu", "--steps", "1",
                 "--draft", str(dirs / "eagle3"), "--out", str(dirs / "never")]) == 2
    assert time.perf_counter() - t0 < 5 and not (dirs / "never").exists()


def test_bench_stops_at_end_of_sequence_like_transformers(dirs, tmp_path):
    """A target whose end-of-sequence token is one it writes early: both engines stop there and count the same
    tokens; --ignore-eos generates exactly --max-tokens."""
    import shutil

    from specserve import LLM, SamplingParams

    folder = tmp_path / "target"
    shutil.copytree(dirs / "target", folder)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Question {i}?"}) + "\n" for i in range(3)))
    plain = LLM(str(folder), device="cpu", dtype="float32")
    ids = [plain.tokenizer.apply_chat_template([{"role": "user", "content": f"Question {i}?"}]) for i in range(3)]
    outs = plain.generate([{"prompt_token_ids": p} for p in ids], SamplingParams(temperature=0, max_tokens=12,
                                                                                 ignore_eos=True))
    eos = outs[0].token_ids[3]  # a token the model writes within the first few
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(dict(cfg, eos_token_id=eos)))
    expect = sum(o.token_ids.index(eos) + 1 if eos in o.token_ids else 12 for o in outs) / 3

    base = dict(model=str(folder), prompts=[str(prompts)], batch_sizes=[1, 2], max_tokens=12, repeats=1,
                speculative="both", draft=str(dirs / "eagle3"), draft_len=2, device="cpu", dtype="float32",
                compare=["hf"])
    rows = run_bench(BenchConfig(**base))["rows"]
    assert expect < 12 and all(r["new_tokens"] == pytest.approx(expect, abs=0.05) for r in rows), \
        [(r["engine"], r["batch"], r["new_tokens"]) for r in rows]
    rows = run_bench(BenchConfig(**dict(base, ignore_eos=True, compare=[])))["rows"]
    assert all(r["new_tokens"] == 12 for r in rows)


def test_max_concurrency_is_vllms_spelling_of_batch_size():
    from specserve.cli import build_parser

    a = build_parser().parse_args(["bench", "--max-concurrency", "1", "8"])
    assert a.batch_size == [1, 8]
    assert build_parser().parse_args(["bench", "--batch-size", "4"]).batch_size == [4]


def _nbytes(params) -> int:
    return sum(p.numel() * p.element_size() for p in params)


def test_roofline_bytes_count_what_a_step_reads(dirs, tmp_path):
    from specserve import LLM
    from specserve.bench.steps import target_read_bytes

    llm = LLM(str(dirs / "target"), device="cpu", dtype="float32",
              speculative_config=dict(method="eagle3", draft_model=str(dirs / "eagle3"), max_draft_len=3))
    m, h = llm.engine.model, llm.engine.head
    # an untied input embedding is read one row per token: not counted; the output layer is
    assert m.lm_head is not None
    assert target_read_bytes(m) == _nbytes(m.parameters()) - _nbytes([m.embed_tokens.weight])
    # EAGLE-3 drafting over the target's lm_head: fc once, then the layer, its norm and that lm_head every step
    per_step = _nbytes(h.midlayer.parameters()) + _nbytes(h.norm.parameters()) + _nbytes([m.lm_head.weight])
    assert h.draft_read_bytes(3, rows=2) == _nbytes(h.fc.parameters()) + 3 * per_step
    # vanilla MTP: step k runs module k once (its own output layer inside it)
    make_head(tmp_path / "mtp", dirs / "target", "mtp", num_modules=2, own_head=True)
    llm = LLM(str(dirs / "target"), device="cpu", dtype="float32",
              speculative_config=dict(method="mtp", draft_model=str(tmp_path / "mtp"), max_draft_len=2,
                                      mtp_eagle=False))
    h = llm.engine.head
    assert not h.eagle and h.draft_read_bytes(2, rows=2) == _nbytes(h.parameters())


def test_layer_costs_count_how_far_each_kernel_moves_the_latest_end():
    """Overlapping kernels (PDL) cost only what they add past the latest end so far."""
    from specserve.bench.timeline import format_layer_costs, layer_costs

    layer = [dict(name="_qkv_rope_kernel", us=3.0, gap_us=0.5),  # starts 0.5 after the kernel before it
             dict(name="_attn_split_kernel", us=5.0, gap_us=-2.0),  # overlaps the qkv kernel by 2
             dict(name="_gemv_kernel", us=1.0, gap_us=-4.0)]  # inside the attention kernel: costs nothing
    order = [dict(name="embed", us=1.0, gap_us=0.0)] + layer * 3 + [dict(name="lm_head", us=9.0, gap_us=0.0)]
    means, n = layer_costs(order)
    assert n == 2  # the last layer, followed by the output layer, is left out
    assert [name for name, _ in means] == ["_qkv_rope_kernel", "_attn_split_kernel", "_gemv_kernel"]
    # layer 1's qkv kernel runs 1.5-4.5 after the embedding's end at 1.0: 3.5; layer 2's runs 5.0-8.0, past the
    # attention kernel's end at 7.5 by 0.5; each attention kernel adds 3.0 and each gemv nothing
    assert [round(us, 6) for _, us in means] == [2.0, 3.0, 0.0]
    assert format_layer_costs(order).endswith("layer 5.00")
    assert format_layer_costs(order[:2]) is None  # no whole layer
