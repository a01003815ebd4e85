"""One-model speculative decoding: losslessness, oracle heads, head KV under chunking, acceptance, checkpoints."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from specserve import LLM, SamplingParams, SpeculativeConfig
from specserve.speculative.accept import accept as accept_rows
from accept_helpers import greedy_inputs
from specserve.speculative.checkpoint import load_draft_head
from specserve.speculative.heads import DraftHead, DraftInputs
from tiny_models import PROMPTS, make_head, make_hf_model

N_OUT = 20
GREEDY = SamplingParams(temperature=0, max_tokens=N_OUT, ignore_eos=True)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec")
    make_hf_model(root / "target", "llama", initializer_range=0.4, num_hidden_layers=8)
    make_head(root / "eagle3", root / "target", "eagle3", draft_vocab=150, seed=1)
    make_head(root / "eagle3_full", root / "target", "eagle3", own_head=False, seed=2)
    make_head(root / "mtp1", root / "target", "mtp", num_modules=1, seed=3)
    make_head(root / "mtp3", root / "target", "mtp", num_modules=3, seed=4)
    return root


def llm_for(dirs, spec=None, **kw) -> LLM:
    kw.setdefault("device", "cpu")
    kw.setdefault("dtype", "float32")
    return LLM(str(dirs / "target"), speculative_config=spec, **kw)


@pytest.fixture(scope="module")
def reference(dirs):
    llm = llm_for(dirs)
    return [llm.generate(p, GREEDY)[0].token_ids for p in PROMPTS]


def assert_all_blocks_free(llm: LLM) -> None:
    assert llm.engine.pool.num_free == llm.engine.pool.num_usable


HEADS = {
    "eagle3-d1": dict(method="eagle3", draft_model="eagle3", max_draft_len=1),
    "eagle3-d4": dict(method="eagle3", draft_model="eagle3", max_draft_len=4),
    "eagle3-target-lm_head-d2": dict(method="eagle3", draft_model="eagle3_full", max_draft_len=2),
    "mtp_eagle-d3": dict(method="mtp", draft_model="mtp1", max_draft_len=3),
    "mtp_eagle-d5": dict(method="mtp", draft_model="mtp1", max_draft_len=5),
    "mtp_eagle-d6-of-3-modules": dict(method="mtp", draft_model="mtp3", max_draft_len=6),
    "mtp_vanilla-d3": dict(method="mtp", draft_model="mtp3", max_draft_len=3, mtp_eagle=False),
    "mtp_vanilla-d1": dict(method="mtp", draft_model="mtp3", max_draft_len=1),
}


def spec_cfg(dirs, name: str) -> dict:
    cfg = dict(HEADS[name])
    cfg["draft_model"] = str(dirs / cfg["draft_model"])
    return cfg


@pytest.mark.parametrize("head", list(HEADS))
def test_lossless_across_batch_sizes_chunking_and_preemption(dirs, reference, head):
    cfg = spec_cfg(dirs, head)
    llm = llm_for(dirs, cfg)
    for batch in (1, 3, 8):
        assert [o.token_ids for o in llm.generate(PROMPTS[:batch], GREEDY)] == reference[:batch]
    assert llm.engine.spec_stats.num_verify_steps > 0
    assert_all_blocks_free(llm)
    for budget in (7, 16):  # 7 divides no prompt; 16 divides some
        chunked = llm_for(dirs, cfg, max_num_batched_tokens=budget)
        assert [o.token_ids for o in chunked.generate(PROMPTS, GREEDY)] == reference
        assert_all_blocks_free(chunked)
    tight = llm_for(dirs, cfg, block_size=4, num_kv_blocks=40, max_num_batched_tokens=29)
    outs = tight.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == reference
    assert sum(o.metrics.num_preemptions for o in outs) > 0
    assert_all_blocks_free(tight)


def test_seeded_sampling_with_speculation_is_reproducible_across_batches(dirs):
    # sampled acceptance keeps the distribution (tests/test_accept.py), not the very samples of plain
    # decoding; with a seed the samples are a function of the request alone
    params = [SamplingParams(temperature=0.9, top_p=0.95, seed=i, max_tokens=N_OUT, ignore_eos=True)
              for i in range(len(PROMPTS))]
    llm = llm_for(dirs, spec_cfg(dirs, "eagle3-d4"))
    together = [o.token_ids for o in llm.generate(PROMPTS, params)]
    alone = [llm.generate(p, sp)[0].token_ids for p, sp in zip(PROMPTS[:3], params[:3])]
    assert together[:3] == alone
    assert llm.engine.spec_stats.num_verify_steps > 0


# ---------------------------------------------------------------------------------------------
# oracle heads


class OracleHead(DraftHead):
    """Drafts the target's own greedy continuation (wrong from draft ``wrong_from`` on, when set)."""

    num_kv_layers = 0

    def __init__(self, refs: dict, vocab: int, wrong_from: int | None = None) -> None:
        super().__init__()
        self.refs, self.vocab, self.wrong_from = refs, vocab, wrong_from

    def propose(self, x: DraftInputs, kv: list, out=None) -> torch.Tensor:  # a new tensor: the worker places it
        out = []
        for row, pos in zip(x.host_rows, x.last_pos.tolist()):
            req = row.request
            full = self.refs.get(tuple(req.token_ids[:req.num_prompt_tokens]), [])
            d = list(full[pos + 2:pos + 2 + x.draft_len])
            d += [0] * (x.draft_len - len(d))
            if self.wrong_from is not None:
                d[self.wrong_from:] = [(t + 1) % self.vocab for t in d[self.wrong_from:]]
            out.append(d)
        return torch.tensor(out, dtype=torch.int64)


def with_oracle(llm: LLM, reference, wrong_from=None) -> LLM:
    refs = {}
    for p, out in zip(PROMPTS, reference):
        ids = llm.tokenizer.encode(p)
        refs[tuple(ids)] = ids + out
    head = OracleHead(refs, llm.engine.model_config.vocab_size, wrong_from).bind(llm.engine.model)
    llm.engine.runner.speculator.drafter.head = head
    return llm


@pytest.mark.parametrize("d", [1, 3, 6])
def test_oracle_head_accepts_everything(dirs, reference, d):
    llm = with_oracle(llm_for(dirs, dict(spec_cfg(dirs, "eagle3-d1"), max_draft_len=d)), reference)
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == reference
    for o in outs:
        s = o.spec
        assert s.num_accepted == s.num_drafted > 0  # every draft verified was accepted
        # every step emits D + 1 tokens except the last ones, where fewer drafts fit before max_tokens
        full_steps = (N_OUT - 1) // (d + 1)
        assert s.num_verify_steps <= full_steps + 1 + (d > 1)
    stats = llm.engine.spec_stats
    assert stats.per_position == [1.0] * d


@pytest.mark.parametrize("k", [0, 1, 2, 3])
def test_oracle_wrong_from_k_accepts_exactly_k(dirs, reference, k):
    d = 4
    llm = with_oracle(llm_for(dirs, dict(spec_cfg(dirs, "eagle3-d1"), max_draft_len=d)), reference, wrong_from=k)
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == reference
    assert llm.engine.spec_stats.per_position == [1.0] * k + [0.0] * (d - k)
    for o in outs:  # every verify step with all D drafts emits exactly k + 1 tokens
        assert o.spec.num_accepted <= k * o.spec.num_verify_steps


def test_stops_inside_an_accepted_run(dirs, reference):
    ref = reference[1]
    stop_tok = ref[7]
    first = ref.index(stop_tok)
    llm = with_oracle(llm_for(dirs, dict(spec_cfg(dirs, "eagle3-d1"), max_draft_len=5)), reference)
    out = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=N_OUT, stop_token_ids=[stop_tok]))[0]
    assert out.token_ids == ref[:first + 1] and out.finish_reason == "stop"
    out = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=9, ignore_eos=True))[0]
    assert out.token_ids == ref[:9] and out.finish_reason == "length"
    plain = llm_for(dirs)
    full_text = plain.generate(PROMPTS[1], GREEDY)[0].text
    stop = full_text[5:8]
    a = plain.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=N_OUT, stop=stop))[0]
    b = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=N_OUT, stop=stop))[0]
    assert (b.text, b.token_ids, b.finish_reason) == (a.text, a.token_ids, "stop")
    assert_all_blocks_free(llm)


def test_forced_acceptance_accepts_exactly_n(dirs):
    llm = llm_for(dirs, dict(spec_cfg(dirs, "eagle3-d4"), forced_acceptance=2))
    outs = llm.generate(PROMPTS[:3], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    stats = llm.engine.spec_stats
    assert stats.per_position[:2] == [1.0, 1.0] and stats.per_position[2:] == [0.0, 0.0]
    assert all(len(o.token_ids) == 40 for o in outs)


def test_fractional_forced_acceptance_matches_its_mean(dirs):
    llm = llm_for(dirs, dict(spec_cfg(dirs, "eagle3-d4"), forced_acceptance=1.5))
    llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    stats = llm.engine.spec_stats
    assert stats.per_position[0] == 1.0 and stats.per_position[2:] == [0.0, 0.0]
    assert 0.4 < stats.per_position[1] < 0.6  # second draft accepted about half the time
    assert abs(stats.acceptance_length - 2.5) < 0.12


# ---------------------------------------------------------------------------------------------
# head KV under chunked prefill


def head_kv_after_prefill(dirs, cfg, budget: int, prompt: str):
    llm = llm_for(dirs, cfg, max_num_batched_tokens=budget)
    eng = llm.engine
    rid = eng.add_request(prompt, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    req = eng.requests[rid]
    while req.num_output_tokens == 0:
        eng.step()
    n = req.num_prompt_tokens
    bs = eng.kv_cache.block_size
    layers = eng.model_config.num_hidden_layers
    slots = torch.tensor([req.block_ids[p // bs] * bs + p % bs for p in range(n)])
    kv = eng.kv_cache.tensor[layers:]  # head layers: [h, 2, blocks, bs, kvh, d]
    return kv.flatten(2, 3)[:, :, slots].clone(), kv.flatten(2, 3)[:eng.model_config.num_hidden_layers].shape


@pytest.mark.parametrize("head", ["eagle3-d4", "mtp_eagle-d3", "mtp_vanilla-d3"])
def test_chunked_prefill_head_kv_equals_unchunked(dirs, head):
    cfg = spec_cfg(dirs, head)
    prompt = PROMPTS[3] + " " + PROMPTS[1]
    whole, _ = head_kv_after_prefill(dirs, cfg, 2048, prompt)
    # vanilla MTP: modules after the first see tokens beyond the chunk only through prompt lookahead,
    # which runs out at the prompt's end; compare the first module (the one every draft step starts from)
    layers = 1 if "vanilla" in head else whole.shape[0]
    for budget in (3, 5, 8, 16):
        chunked, _ = head_kv_after_prefill(dirs, cfg, budget, prompt)
        assert torch.allclose(chunked[:layers], whole[:layers], rtol=1e-4, atol=1e-4), budget
    assert whole.abs().sum() > 0


@pytest.mark.parametrize("head", ["eagle3-d4", "mtp_eagle-d3"])
def test_draft_step0_over_last_tokens_equals_all_tokens(dirs, head):
    # draft step 0 runs attention and the MLP for each row's last accepted token only; computing every token
    # and gathering must give the same outputs, KV and drafts, chunked prefill and mixed batches included
    def all_tokens(h, x, kv):  # the module over all T tokens, then each row's last one
        return h.run_module(0, x.step0_ids, x.positions, h.first_hidden(x.hidden, x.aux), x.meta,
                            kv[h.kv_layer(0)])[x.last_idx]

    def run(mode):
        llm = llm_for(dirs, spec_cfg(dirs, head), max_num_batched_tokens=7)
        h = llm.engine.runner.speculator.drafter.head
        outs, drafts = [], []
        step0, propose = (h.step0 if mode == "last" else lambda x, kv: all_tokens(h, x, kv)), h.propose
        h.step0 = lambda x, kv: outs.append(step0(x, kv)) or outs[-1]
        h.propose = lambda x, kv, out=None: drafts.append(propose(x, kv)) or drafts[-1]  # a new tensor each step
        tokens = [o.token_ids for o in llm.generate(PROMPTS[:4], GREEDY)]
        return tokens, outs, drafts, llm.engine.kv_cache.tensor[llm.engine.model_config.num_hidden_layers:].clone()

    tokens, outs, drafts, kv = run("last")
    tokens_all, outs_all, drafts_all, kv_all = run("all")
    assert tokens == tokens_all
    assert len(outs) == len(outs_all) > 5 and all(o.shape == a.shape for o, a in zip(outs, outs_all))
    assert max((o - a).abs().max().item() for o, a in zip(outs, outs_all)) < 1e-4
    assert all(torch.equal(d, a) for d, a in zip(drafts, drafts_all))
    assert torch.allclose(kv, kv_all, atol=1e-5) and kv.abs().sum() > 0


# ---------------------------------------------------------------------------------------------
# acceptance on hand-built tokens


def accept(target, drafts, nd=None, can=None, forced=None):
    """Greedy acceptance where the target's argmax at each position is ``target``."""
    target = torch.tensor(target)
    drafts = torch.tensor(drafts)
    b = target.shape[0]
    logits = torch.nn.functional.one_hot(target, 10).float() * 5.0  # [B, D+1, V]: argmax = target
    nd = torch.tensor(nd) if nd is not None else torch.full((b,), drafts.shape[1])
    can = torch.tensor(can) if can is not None else torch.ones(b, dtype=torch.bool)
    acc, em = accept_rows(logits, drafts, nd, greedy_inputs(b, can), forced)
    return acc.tolist(), [e[:a + 1] for e, a in zip(em.tolist(), acc.tolist())]


def test_greedy_accept_rules():
    # all accepted, none, first rejected, last rejected
    assert accept([[5, 6, 7, 8]], [[5, 6, 7]]) == ([3], [[5, 6, 7, 8]])
    assert accept([[5, 6, 7, 8]], [[9, 9, 9]]) == ([0], [[5]])
    assert accept([[5, 6, 7, 8]], [[1, 6, 7]]) == ([0], [[5]])
    assert accept([[5, 6, 7, 8]], [[5, 6, 1]]) == ([2], [[5, 6, 7]])
    # a later match after a mismatch does not count; rows are independent
    assert accept([[5, 6, 7, 8], [1, 2, 3, 4]], [[5, 0, 7], [1, 2, 0]]) == ([1, 2], [[5, 6], [1, 2, 3]])
    # drafts past num_drafts are ignored; rows that verify none take position 0
    assert accept([[5, 6, 7, 8]], [[5, 6, 7]], nd=[2]) == ([2], [[5, 6, 7]])
    assert accept([[5, 6, 7, 8]], [[5, 6, 7]], can=[False]) == ([0], [[5]])
    # forced acceptance takes drafts as they are
    assert accept([[5, 6, 7, 8]], [[1, 2, 3]], forced=2) == ([2], [[1, 2, 7]])


def test_ties_resolve_like_plain_greedy():
    # a tie between tokens 2 and 3 at the first position: argmax takes the first (2), exactly what
    # non-speculative greedy decoding emits, so a draft of 3 is rejected and 2 is the bonus
    logits = torch.tensor([[[0.0, 1.0, 5.0, 5.0], [0.0, 9.0, 0.0, 0.0]]])
    one = torch.tensor([1])
    acc, em = accept_rows(logits, torch.tensor([[3]]), one, greedy_inputs(1))
    assert (acc.item(), em[0, :1].tolist()) == (0, [2])
    acc, em = accept_rows(logits, torch.tensor([[2]]), one, greedy_inputs(1))
    assert (acc.item(), em[0, :2].tolist()) == (1, [2, 1])


# ---------------------------------------------------------------------------------------------
# checkpoints


def test_written_head_reads_back_identically(dirs):
    from specserve.loaders import load_model
    from specserve.speculative.checkpoint import save_eagle3_head, save_mtp_head

    target = load_model(str(dirs / "target"), torch.float32, torch.device("cpu")).model
    for name, saver in (("eagle3-d4", save_eagle3_head), ("mtp_vanilla-d3", save_mtp_head)):
        spec = SpeculativeConfig(**spec_cfg(dirs, name))
        a = load_draft_head(spec, target, "cpu", torch.float32)
        out = dirs / f"roundtrip-{name}"
        saver(a, out)
        spec.draft_model = str(out)
        b = load_draft_head(spec, target, "cpu", torch.float32)
        sa, sb = a.state_dict(), b.state_dict()
        assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
        assert b.aux_layers == a.aux_layers
    # and the same drafts, through the engine
    cfg = spec_cfg(dirs, "eagle3-d4")
    one = llm_for(dirs, cfg)
    two = llm_for(dirs, dict(cfg, draft_model=str(dirs / "roundtrip-eagle3-d4")))
    e1, e2 = one.engine, two.engine
    r1, r2 = e1.add_request(PROMPTS[1], GREEDY), e2.add_request(PROMPTS[1], GREEDY)
    for _ in range(4):
        e1.step(), e2.step()
        assert e1.requests[r1].spec_token_ids == e2.requests[r2].spec_token_ids


def test_eagle3_layout_written_with_plain_safetensors_loads(dirs, reference, tmp_path):
    """As other tools write it: unfused names, d2t/t2d, aux ids in the input-of-layer convention."""
    src = json.loads((dirs / "target" / "config.json").read_text())
    h, inter, v, dv = src["hidden_size"], src["intermediate_size"], src["vocab_size"], 100
    hd = h // src["num_attention_heads"]
    kvd = src["num_key_value_heads"] * hd
    g = torch.Generator().manual_seed(0)

    def r(*shape):
        return torch.randn(*shape, generator=g) * 0.05

    ids = torch.randperm(v, generator=g)[:dv].sort().values
    t2d = torch.zeros(v, dtype=torch.bool)
    t2d[ids] = True
    tensors = {
        "fc.weight": r(h, 3 * h), "norm.weight": torch.ones(h), "lm_head.weight": r(dv, h),
        "d2t": ids - torch.arange(dv), "t2d": t2d,
        "midlayer.input_layernorm.weight": torch.ones(h), "midlayer.hidden_norm.weight": torch.ones(h),
        "midlayer.post_attention_layernorm.weight": torch.ones(h),
        "midlayer.self_attn.q_proj.weight": r(h, 2 * h), "midlayer.self_attn.k_proj.weight": r(kvd, 2 * h),
        "midlayer.self_attn.v_proj.weight": r(kvd, 2 * h), "midlayer.self_attn.o_proj.weight": r(h, h),
        "midlayer.mlp.gate_proj.weight": r(inter, h), "midlayer.mlp.up_proj.weight": r(inter, h),
        "midlayer.mlp.down_proj.weight": r(h, inter),
    }
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLMEagle3"], "hidden_size": h, "intermediate_size": inter,
        "num_attention_heads": src["num_attention_heads"], "num_key_value_heads": src["num_key_value_heads"],
        "vocab_size": v, "draft_vocab_size": dv, "num_hidden_layers": 1, "rms_norm_eps": 1e-5,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 4, 5]},
    }))
    llm = llm_for(dirs, dict(method="eagle3", draft_model=str(tmp_path), max_draft_len=3))
    assert llm.engine.head.aux_layers == (1, 3, 4)
    assert torch.equal(llm.engine.head.d2t, ids - torch.arange(dv))
    assert [o.token_ids for o in llm.generate(PROMPTS[:2], GREEDY)] == reference[:2]
    drafted = [t for t in llm.engine.requests.values()]  # all finished
    assert not drafted


@pytest.mark.parametrize("mutate, message", [
    (lambda c, t: c.update(hidden_size=c["hidden_size"] * 2), "hidden_size"),
    (lambda c, t: c.update(vocab_size=7), "vocab_size"),
    (lambda c, t: t.pop("midlayer.mlp.up_proj.weight"), "missing tensor 'midlayer.mlp.up_proj.weight'"),
    (lambda c, t: t.update({"fc.weight": t["fc.weight"][:, :5].contiguous()}), "fc.weight"),
    (lambda c, t: t.pop("d2t"), "d2t"),
])
def test_bad_heads_give_clear_errors(dirs, tmp_path, mutate, message):
    from safetensors.torch import load_file

    cfg = json.loads((dirs / "eagle3" / "config.json").read_text())
    tensors = load_file(str(dirs / "eagle3" / "model.safetensors"))
    mutate(cfg, tensors)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=message):
        llm_for(dirs, dict(method="eagle3", draft_model=str(tmp_path)))


@pytest.mark.parametrize("kwargs, message", [
    (dict(method="medusa"), "medusa"),
    (dict(max_draft_len=0), "max_draft_len"),
    (dict(max_draft_len=17), "max_draft_len"),
    (dict(method="eagle3", mtp_eagle=True), "mtp_eagle"),
    (dict(forced_acceptance=5, max_draft_len=4), "forced_acceptance"),
    (dict(eagle3_layers_to_capture=(1, 2)), "three"),
])
def test_speculative_config_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig(**kwargs)


def test_vanilla_mtp_needs_a_module_per_draft(dirs):
    with pytest.raises(ValueError, match="one module per draft position"):
        llm_for(dirs, dict(method="mtp", draft_model=str(dirs / "mtp1"), max_draft_len=3, mtp_eagle=False))
    with pytest.raises(ValueError, match="not a folder"):
        llm_for(dirs, dict(method="mtp", draft_model=str(dirs / "nope")))


def test_results_and_cli_report_spec_metrics(dirs):
    import subprocess
    import sys

    llm = llm_for(dirs, spec_cfg(dirs, "eagle3-d4"))
    out = llm.generate(PROMPTS[0], GREEDY)[0]
    m = out.spec_metrics()
    # the first token comes from the prefill, the last from a step with no room left for drafts
    assert m["emitted"] == N_OUT - 2 and m["acceptance_length"] == pytest.approx((N_OUT - 2) / m["verify_steps"])
    assert m["verify_steps"] < m["drafted"] <= 4 * m["verify_steps"]
    assert len(m["per_position_acceptance"]) == 4
    cmd = [sys.executable, "-m", "specserve.cli", "generate", "Hello world", "--model", str(dirs / "target"),
           "--draft", str(dirs / "eagle3"), "--draft-len", "3", "--json", "--stats", "--max-tokens", "10",
           "--ignore-eos", "--no-chat-template", "--device", "cpu"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    obj = json.loads(proc.stdout)
    assert set(obj["spec"]) >= {"drafted", "accepted", "acceptance_rate", "acceptance_length",
                                "per_position_acceptance"}
    assert obj["token_ids"] == llm.generate("Hello world", SamplingParams(temperature=0, max_tokens=10,
                                                                          ignore_eos=True))[0].token_ids
    assert "acceptance length" in proc.stderr and "tokens/s" in proc.stderr
