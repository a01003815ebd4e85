"""Engine behaviour on a tiny random Llama: batching, chunked prefill, preemption, sampling, stops, errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from specserve import LLM, SamplingParams
from tiny_models import PROMPTS, make_hf_model

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_llama")
    make_hf_model(d, "llama", initializer_range=0.4, num_hidden_layers=2)
    return str(d)


def make_llm(model_dir, **kw) -> LLM:
    kw.setdefault("device", "cpu")
    kw.setdefault("dtype", "float32")
    return LLM(model_dir, **kw)


@pytest.fixture(scope="module")
def llm(model_dir):
    return make_llm(model_dir)


@pytest.fixture(scope="module")
def reference(llm):
    """Greedy outputs produced one request at a time, whole prompt in one step."""
    return [llm.generate(p, GREEDY)[0].token_ids for p in PROMPTS]


def assert_all_blocks_free(llm: LLM) -> None:
    pool = llm.engine.pool
    assert pool.num_free == pool.num_usable
    assert not llm.engine.scheduler.running and not llm.engine.scheduler.waiting


@pytest.mark.parametrize("batch", [1, 2, 5, 8])
def test_batched_equals_single(llm, reference, batch):
    outs = llm.generate(PROMPTS[:batch], GREEDY)
    assert [o.token_ids for o in outs] == reference[:batch]
    assert all(len(o.token_ids) == 24 and o.finish_reason == "length" for o in outs)
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("budget", [3, 7, 16, 33])
def test_chunked_prefill_equals_single(model_dir, reference, budget):
    # budgets 3 and 7 divide none of the prompts evenly; 16 divides some; all force chunking
    llm = make_llm(model_dir, max_num_batched_tokens=budget)
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == reference
    assert_all_blocks_free(llm)


def test_preemption_by_recompute(model_dir, reference):
    # 24 blocks of 4 tokens: far too few for 8 requests of ~40 tokens, so requests get preempted
    llm = make_llm(model_dir, block_size=4, num_kv_blocks=24, max_num_batched_tokens=13)
    outs = llm.generate(PROMPTS, GREEDY)
    assert sum(o.metrics.num_preemptions for o in outs) > 0
    assert [o.token_ids for o in outs] == reference
    assert_all_blocks_free(llm)


def test_max_num_seqs_limits_running(model_dir, reference):
    llm = make_llm(model_dir, max_num_seqs=2)
    eng = llm.engine
    for p in PROMPTS:
        eng.add_request(p, GREEDY)
    most = 0
    while eng.has_unfinished_requests():
        eng.step()
        most = max(most, len(eng.scheduler.running))
    assert most == 2
    assert_all_blocks_free(llm)


def test_prompt_token_ids_and_dict_prompts(llm, reference):
    ids = llm.tokenizer.encode(PROMPTS[0])
    a = llm.generate([ids], GREEDY)[0]
    b = llm.generate({"prompt_token_ids": ids}, GREEDY)[0]
    assert a.token_ids == b.token_ids == reference[0]
    assert a.prompt_token_ids == ids


# ---------------------------------------------------------------------------------------------
# sampling


def test_seeded_sampling_is_reproducible_across_batches_and_preemption(model_dir):
    sp = SamplingParams(temperature=1.0, seed=1234, max_tokens=20, ignore_eos=True)
    llm = make_llm(model_dir)
    alone = llm.generate(PROMPTS[1], sp)[0].token_ids
    others = [SamplingParams(temperature=0.8, top_p=0.9, seed=i, max_tokens=20, ignore_eos=True) for i in range(7)]
    mixed = llm.generate(PROMPTS, [others[0], sp] + others[1:])[1].token_ids
    tiny = make_llm(model_dir, block_size=4, num_kv_blocks=24, max_num_batched_tokens=5)
    preempted = tiny.generate(PROMPTS, [others[0], sp] + others[1:])
    assert alone == mixed == preempted[1].token_ids
    assert sum(o.metrics.num_preemptions for o in preempted) > 0
    # a different seed gives a different sample, and sampling differs from greedy
    other_seed = llm.generate(PROMPTS[1], SamplingParams(temperature=1.0, seed=99, max_tokens=20,
                                                         ignore_eos=True))[0].token_ids
    greedy = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0].token_ids
    assert alone != other_seed and alone != greedy


def test_top_k_one_is_greedy_and_mixed_params_share_a_step(llm, reference):
    params = [SamplingParams(temperature=1.3, top_k=1, seed=i, max_tokens=24, ignore_eos=True) for i in range(4)]
    params += [SamplingParams(temperature=0.9, min_p=1.0, seed=7, max_tokens=24, ignore_eos=True)]  # keeps only top-1
    params += [GREEDY, SamplingParams(temperature=2.0, top_p=0.5, seed=3, max_tokens=24, ignore_eos=True), GREEDY]
    outs = llm.generate(PROMPTS, params)
    for i in (0, 1, 2, 3, 4, 5, 7):
        assert outs[i].token_ids == reference[i]


# ---------------------------------------------------------------------------------------------
# stopping


def test_stop_token_ids_max_tokens_and_eos(llm, reference):
    ref = reference[2]
    stop_tok = ref[5]
    first = ref.index(stop_tok)
    out = llm.generate(PROMPTS[2], SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop_tok]))[0]
    assert out.token_ids == ref[:first + 1]
    assert out.finish_reason == "stop" and out.outputs[0].stop_reason == stop_tok

    out = llm.generate(PROMPTS[2], SamplingParams(temperature=0, max_tokens=7, ignore_eos=True))[0]
    assert out.token_ids == ref[:7] and out.finish_reason == "length"

    eng = llm.engine
    saved = eng.model_config.eos_token_ids
    try:
        eng.model_config.eos_token_ids = (stop_tok,)
        out = llm.generate(PROMPTS[2], SamplingParams(temperature=0, max_tokens=24))[0]
        assert out.token_ids == ref[:first + 1] and out.finish_reason == "stop"
        assert out.outputs[0].stop_reason is None
        out = llm.generate(PROMPTS[2], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0]
        assert out.token_ids == ref
    finally:
        eng.model_config.eos_token_ids = saved
    assert_all_blocks_free(llm)


def test_stop_strings(llm):
    full = llm.generate(PROMPTS[3], GREEDY)[0]
    text = full.text
    assert len(text) > 12
    stop = text[6:10]
    first = text.index(stop)
    out = llm.generate(PROMPTS[3], SamplingParams(temperature=0, max_tokens=24, stop=[stop, "\x00never"]))[0]
    assert out.text == text[:first]
    assert out.finish_reason == "stop" and out.outputs[0].stop_reason == stop
    assert len(out.token_ids) < len(full.token_ids)
    kept = llm.generate(PROMPTS[3], SamplingParams(temperature=0, max_tokens=24, stop=stop,
                                                   include_stop_str_in_output=True))[0]
    assert kept.text == text[:first + len(stop)]


def test_incremental_text_matches_full_decode(llm):
    outs = llm.generate(PROMPTS, [SamplingParams(temperature=1.0, seed=i, max_tokens=30, ignore_eos=True)
                                  for i in range(len(PROMPTS))])
    for o in outs:  # but an incomplete UTF-8 sequence at the cut (max_tokens) is held back, not shown as U+FFFD
        assert o.text == llm.tokenizer.decode(o.token_ids).rstrip("\ufffd")


def test_streaming_deltas_concatenate_to_text(llm):
    eng = llm.engine
    rid = eng.add_request(PROMPTS[0], GREEDY)
    deltas, ids, final = [], [], None
    while eng.has_unfinished_requests():
        for out in eng.step():
            assert out.request_id == rid
            deltas.append(out.delta_text)
            ids += out.delta_token_ids
            final = out
    assert "".join(deltas) == final.text and ids == final.token_ids


def test_streamed_text_never_shows_a_stop_string_that_completes_in_a_later_step(llm):
    """One token a step: a stop string spread over several steps cuts the text where it began, so the text its
    first tokens added must never have been streamed (held back while a stop string may complete); the deltas
    always add up to a prefix of the final text, and at the end to the text."""
    eng = llm.engine
    full = llm.generate(PROMPTS[3], GREEDY)[0]
    text = full.text
    # a stop string of the text of tokens 2-5: it begins steps before it completes
    ends = [len(llm.tokenizer.decode(full.token_ids[:k])) for k in range(1, 6)]
    stop = text[ends[0]:ends[4]]
    assert ends[0] < ends[1] < ends[4] and text.index(stop) == ends[0]
    rid = eng.add_request(PROMPTS[3], SamplingParams(temperature=0, max_tokens=24, stop=[stop]))
    shown, final = "", None
    while eng.has_unfinished_requests():
        for out in eng.step():
            assert out.request_id == rid
            shown += out.delta_text
            final = out
            assert stop[0] not in shown[text.index(stop):] and text.startswith(shown)
    assert final.finished and shown == final.text == text[:text.index(stop)]


# ---------------------------------------------------------------------------------------------
# errors


@pytest.mark.parametrize("prompt, params, message", [
    ("", GREEDY, "prompt is empty"),
    ([], GREEDY, "prompt is empty"),
    ([1, 2, 10**6], GREEDY, "outside the vocabulary"),
    ([5] * 600, GREEDY, "context"),
])
def test_bad_prompts_are_rejected_and_engine_keeps_serving(llm, reference, prompt, params, message):
    eng = llm.engine
    good = eng.add_request(PROMPTS[0], GREEDY)
    with pytest.raises(ValueError, match=message):
        eng.add_request(prompt, params)
    done = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
    assert done[good].token_ids == reference[0]
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("kwargs, field", [
    (dict(temperature=-1), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-5), "top_k"),
    (dict(min_p=2.0), "min_p"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(stop=[""]), "stop"),
    (dict(n=0), "n"),
    (dict(n=129), "n"),
    (dict(n=True), "n"),
    (dict(top_p="0.9"), "top_p"),
    (dict(max_tokens=True), "max_tokens"),
    (dict(seed=1.5), "seed"),
])
def test_invalid_sampling_values(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_seed_and_top_k_past_64_bits_run(llm):
    """Values past the device's int64 mean what they say: a seed modulo 2**64, a top-k that keeps all."""
    big = SamplingParams(temperature=0.8, max_tokens=6, seed=2 ** 64 + 7, top_k=2 ** 63, ignore_eos=True)
    same = SamplingParams(temperature=0.8, max_tokens=6, seed=7, ignore_eos=True)
    assert llm.generate(PROMPTS[0], big)[0].token_ids == llm.generate(PROMPTS[0], same)[0].token_ids
    assert_all_blocks_free(llm)


def test_a_failing_step_leaves_no_request_behind(llm, reference, monkeypatch):
    eng = llm.engine
    real = eng.step
    monkeypatch.setattr(eng, "step", lambda: (_ for _ in ()).throw(RuntimeError("device lost")))
    with pytest.raises(RuntimeError, match="device lost"):
        llm.generate(PROMPTS[:2], GREEDY)
    monkeypatch.setattr(eng, "step", real)
    assert not eng.has_unfinished_requests()
    assert_all_blocks_free(llm)
    assert llm.generate(PROMPTS[0], GREEDY)[0].token_ids == reference[0]


def test_generate_reports_errors_per_prompt_without_losing_others(llm, reference):
    outs = llm.generate([PROMPTS[0], "", PROMPTS[2]], GREEDY, raise_on_error=False)
    assert outs[0].token_ids == reference[0] and outs[2].token_ids == reference[2]
    assert outs[1].finish_reason == "error" and "empty" in outs[1].error
    with pytest.raises(ValueError, match="prompt 1: prompt is empty"):
        llm.generate([PROMPTS[0], ""], GREEDY)
    assert_all_blocks_free(llm)


def test_abort_frees_blocks(llm):
    eng = llm.engine
    rid = eng.add_request(PROMPTS[1], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    keep = eng.add_request(PROMPTS[0], GREEDY)
    for _ in range(3):
        eng.step()
    assert eng.pool.num_free < eng.pool.num_usable
    eng.abort_request(rid)
    while eng.has_unfinished_requests():
        eng.step()
    assert keep not in eng.requests
    assert_all_blocks_free(llm)


def test_chat_applies_template(llm):
    msgs = [{"role": "user", "content": "Hello world"}]
    out = llm.chat(msgs, GREEDY)[0]
    expected = llm.tokenizer.encode("<|im_start|>user\nHello world<|im_end|>\n<|im_start|>assistant\n")
    assert out.prompt_token_ids == expected
    with pytest.raises(ValueError, match="role"):
        llm.chat([{"content": "x"}])
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "world"}]}]
    assert llm.chat(parts, GREEDY)[0].prompt_token_ids == llm.tokenizer.encode(
        "<|im_start|>user\nHello\nworld<|im_end|>\n<|im_start|>assistant\n")


def test_unknown_llm_argument(model_dir):
    with pytest.raises(TypeError, match="max_num_seq"):
        LLM(model_dir, max_num_seq=3)


def test_a_steps_tokens_are_appended_up_to_the_one_that_ends_the_request():
    """``Request.append_tokens`` (one call a row a step) keeps the tokens up to the first stop token, the
    ``max_tokens``-th output token or the ``max_total_tokens``-th token, and finishes the request there, as
    appending them one at a time does; a thinking phase follows the tokens kept."""
    from specserve.core.request import Request

    def req(max_tokens=None, max_total=100, stop=(9,), eos=(2,), ignore_eos=False):
        sp = SamplingParams(temperature=0, max_tokens=max_tokens, stop_token_ids=list(stop), ignore_eos=ignore_eos)
        return Request("r", None, [1, 3, 4], sp, max_total, eos, thinking_tokens=(50, 51))

    for tokens, kw, kept, reason, stop_reason in (
            ([5, 6, 7], {}, [5, 6, 7], None, None),
            ([5, 9, 7], {}, [5, 9], "stop", 9),  # a stop token id: reported as the stop reason
            ([5, 2, 7], {}, [5, 2], "stop", None),  # EOS
            ([5, 2, 7], dict(ignore_eos=True), [5, 2, 7], None, None),
            ([5, 6, 7], dict(max_tokens=2), [5, 6], "length", None),
            ([5, 6, 7], dict(max_total=5), [5, 6], "length", None),
            ([5, 9, 7], dict(max_tokens=2), [5, 9], "stop", 9),  # a stop at the limit is a stop
            ([50, 6, 51], {}, [50, 6, 51], None, None),
            ([5, 9, 50], {}, [5, 9], "stop", 9),  # the thinking phase follows only the tokens kept
            ([5, 6], dict(max_total=3), [5], "length", None)):  # no room left: one token, as one at a time
        one, many = req(**kw), req(**kw)
        for t in tokens:
            if not one.finished:
                one.append_token(t)
        assert many.append_tokens(tokens) == len(kept)
        assert many.output_token_ids == one.output_token_ids == kept, (tokens, kw)
        assert many.finish_reason == one.finish_reason == reason and many.stop_reason == stop_reason
        assert many.thinking == one.thinking
    r = req()
    r.append_tokens([5, 50, 6])
    assert r.thinking
    r.append_tokens([51, 7])
    assert not r.thinking


def test_an_engine_freezes_its_start_heap_and_one_dropped_since_is_collected(model_dir, tmp_path):
    """An engine moves the objects of its start out of the collector's reach (``gc.freeze``: a full collection
    walked them inside a step). A dropped engine, speculative included, is freed at once (no cycle holds it); one
    that a cycle does hold is collectable again once the next engine starts (on a GPU collected before that one
    loads its weights)."""
    import gc
    import weakref

    from tiny_models import make_head

    make_head(tmp_path / "eagle3", Path(model_dir), "eagle3", own_head=False, seed=1)
    spec = make_llm(model_dir, speculative_config=dict(method="eagle3", draft_model=str(tmp_path / "eagle3"),
                                                       max_draft_len=2, adaptive_draft_len=True))
    assert gc.get_freeze_count() > 0
    ref = weakref.ref(spec.engine)
    del spec
    assert ref() is None  # freed by its reference count, frozen or not
    first = make_llm(model_dir)
    ref = weakref.ref(first.engine)
    first.engine.cycle = first.engine  # only the collector can free it
    del first
    gc.collect()
    assert ref() is not None  # frozen: out of the collector's reach
    second = make_llm(model_dir)
    gc.collect()
    assert ref() is None
    assert second.generate(PROMPTS[0], GREEDY)[0].token_ids
