"""CUDA-graph steps: fixed padded layouts (dummy rows, padded draft slots) give the same outputs as packed eager
steps. On the CPU the padded layout runs without capture (``CudaGraphs(capture=False)``); on the GPU machine
graphs are captured and replayed and must equal ``enforce_eager=True``."""

from __future__ import annotations

import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.runner.cuda_graph import CudaGraphs, capture_sizes
from specserve.runner.graph_inputs import row_fields, stage_record
from specserve.runner.graph_layout import prefill_q
from specserve.runner.model_runner import ModelRunner
from specserve.runner.staging import Staging
from tiny_models import PROMPTS, target_with_heads


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return target_with_heads(tmp_path_factory.mktemp("graphs"), num_hidden_layers=4)


SPECS = {
    "no-spec": None,
    "eagle3-d3": dict(method="eagle3", draft_model="eagle3", max_draft_len=3),
    "mtp-d2": dict(method="mtp", draft_model="mtp", max_draft_len=2),
}
PARAMS = [
    SamplingParams(temperature=0, max_tokens=17, ignore_eos=True),
    SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=13, ignore_eos=True),
    SamplingParams(temperature=0, max_tokens=9, ignore_eos=True),
]


def test_capture_sizes():
    assert capture_sizes(1) == [1]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(64)[-3:] == [48, 56, 64]


def _run(dirs, spec, n_prompts, padded: bool, device="cpu", dtype="float32", **kw):
    if device == "cuda":  # a small cache: tests hold two engines at once, each of which would take 90% of the GPU
        kw.setdefault("kv_cache_memory_bytes", 1 << 28)
    llm = LLM(str(dirs / "target"), device=device, dtype=dtype,
              speculative_config=None if spec is None else dict(spec, draft_model=str(dirs / spec["draft_model"])),
              **kw)
    runner = llm.engine.runner
    if padded:  # the graph layouts, run eagerly (the CPU has no CUDA graphs)
        runner.graphs = CudaGraphs(8, runner._staging_buffers(), capture=False)
    prompts = (PROMPTS * 3)[:n_prompts]
    params = [PARAMS[i % len(PARAMS)] for i in range(n_prompts)]
    outs = llm.generate(prompts, params)
    return [o.token_ids for o in outs], llm


@pytest.mark.parametrize("spec", list(SPECS), ids=str)
@pytest.mark.parametrize("n", [1, 3, 6])
def test_padded_graph_layout_equals_packed_steps(dirs, spec, n):
    ref, _ = _run(dirs, SPECS[spec], n, padded=False)
    got, llm = _run(dirs, SPECS[spec], n, padded=True)
    assert got == ref
    assert llm.engine.runner.graphs.steps >= 8  # most steps ran in the padded layout
    assert llm.engine.pool.num_free == llm.engine.pool.num_usable


def test_one_token_graph_steps_sample_every_row_without_a_gather(dirs, monkeypatch):
    """A decode graph (one token per row) reads the logits of every hidden row in order, so it takes no
    gather of the rows (``logits_indices`` None); a prefill graph still picks the prompt's last token. Tokens
    equal packed steps', one row a step (each prompt a prefill graph) and three rows padded to four (greedy and
    sampled rows: a wrong row order would change them)."""
    ref, _ = _run(dirs, None, 3, padded=False)
    seen = []  # (rows, tokens per row, no gather) of every graph step
    graph_batch = ModelRunner.graph_batch

    def views(self, rec, *args):
        out = graph_batch(self, rec, *args)
        seen.append((rec.rows, rec.q, out.logits_indices is None))
        return out

    monkeypatch.setattr(ModelRunner, "graph_batch", views)
    assert _run(dirs, None, 3, padded=True, max_num_seqs=1)[0] == ref
    assert any(q > 1 for _, q, _ in seen)  # prefill graphs ran
    assert _run(dirs, None, 3, padded=True)[0] == ref
    assert any(rows > 1 and q == 1 for rows, q, _ in seen)  # decode graphs of several rows ran
    assert all(none == (q == 1) for _, q, none in seen)


def test_a_prefill_layout_as_wide_as_a_verify_step_is_not_taken_for_one(dirs, monkeypatch):
    """D = 15: a one-row prefill graph (16 tokens) has the q of a generation step (1 + D), and must still read
    the logits at the prompt's last token (a generation layout's verify step reads them at every token)."""
    spec = dict(method="eagle3", draft_model="eagle3", max_draft_len=15)
    ref, _ = _run(dirs, spec, 1, padded=False)
    taken = []
    graph_layout = ModelRunner.graph_layout
    monkeypatch.setattr(ModelRunner, "graph_layout", lambda self, b: taken.append(graph_layout(self, b)) or taken[-1])
    got, _ = _run(dirs, spec, 1, padded=True)
    assert got == ref
    assert any(t is not None and t.prefill and t.q == 16 for t in taken)  # the prompt ran as a prefill graph
    assert any(t is not None and not t.prefill and t.q == 16 for t in taken)  # and verify steps of 1 + 15


@pytest.mark.parametrize("spec", ["no-spec", "eagle3-d3"])
def test_a_record_rewritten_in_place_equals_one_staged_whole(dirs, spec, monkeypatch):
    """From the second graph step of the same rows on, only the fields that change per step are rewritten
    (tokens, positions, block tables, sampling offsets, the thinking flags): the buffer must then hold exactly
    what staging the whole record writes, and the step the same switches."""
    llm = LLM(str(dirs / "target"), device="cpu", dtype="float32",
              speculative_config=None if SPECS[spec] is None else dict(SPECS[spec],
                                                                      draft_model=str(dirs / "eagle3")))
    runner = llm.engine.runner
    runner.graphs = CudaGraphs(8, runner._staging_buffers(), capture=False)
    real_stage = runner.stage_graph
    rewritten = []

    def stage(batch, layout, step_spec=None):
        for i, s in enumerate(batch.scheduled):  # the thinking flag as a relaxed phase would move it
            s.request.thinking = (runner.graphs.steps + i) % 3 == 0
        rec, switches = real_stage(batch, layout, step_spec)
        last = runner._last_record
        rewritten.append(last.restaged is not None and last.record is rec)
        scratch = Staging(torch.int64, torch.device("cpu"))
        ints, tables = row_fields(batch.scheduled, layout.rows, layout.q, runner.block_size, runner.table_lookahead)
        floats: dict = {}
        assert runner._record_params(batch.scheduled, layout.rows, ints, floats, step_spec) == switches
        whole = stage_record(scratch, batch.scheduled, layout.rows, layout.q, layout.table_width, ints, tables, floats)
        assert (whole.fields, whole.float_fields, whole.size) == (rec.fields, rec.float_fields, rec.size)
        assert torch.equal(scratch.host[:whole.size], runner._ints.host[:rec.size])
        return rec, switches

    monkeypatch.setattr(runner, "stage_graph", stage)
    outs = llm.generate(PROMPTS[:3], PARAMS)
    assert all(o.token_ids for o in outs)
    assert sum(rewritten) >= 5 and not rewritten[0]  # most steps rewrote in place; the first staged whole


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("spec", list(SPECS), ids=str)
@pytest.mark.parametrize("dtype,backend", [("float32", "auto"), ("bfloat16", "auto"), ("float32", "sdpa")])
def test_cuda_graphs_equal_eager(dirs, spec, dtype, backend):
    """Both attention backends: SDPA's mask must be built inside the captured step, not reused from it.
    ``enforce_eager`` runs the graphs' padded layouts uncaptured; in float32 they equal packed steps too."""
    for n in (1, 3, 6):
        kw = dict(device="cuda", dtype=dtype, attention_backend=backend)
        ref, eager = _run(dirs, SPECS[spec], n, padded=False, enforce_eager=True, **kw)
        got, llm = _run(dirs, SPECS[spec], n, padded=False, **kw)
        assert llm.engine.runner.graphs.num_captured > 0 and eager.engine.runner.graphs.num_captured == 0
        assert got == ref, (spec, dtype, backend, n)
        if dtype == "float32":
            packed, llm = _run(dirs, SPECS[spec], n, padded=False, max_cuda_graph_batch_size=0, **kw)
            assert llm.engine.runner.graphs is None
            assert packed == ref, (spec, backend, n)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_graphs_are_recaptured_after_a_staging_buffer_moves():
    """A batch larger than any before grows the staging buffers: every graph is dropped with the memory
    pool they shared, and the next capture must start a new pool (reusing the freed one's handle tripped an
    allocator assertion in the H200 throughput run)."""
    from specserve.runner.staging import Staging

    st = Staging(torch.float32, torch.device("cuda"), 16)
    graphs = CudaGraphs(1, [st])

    def step():  # reads the staging buffer in place, as a captured step does
        return st.dev[:4] * 2 + 1

    def run(key, values):
        st.reserve(4)[:4] = values
        st.upload(4)
        return graphs.run(key, step).tolist()

    assert run("a", [1, 2, 3, 4]) == [3, 5, 7, 9]
    assert run("a", [0, 1, 0, 1]) == [1, 3, 1, 3]  # a replay
    st.reserve(5000)  # moves the buffers
    assert run("b", [2, 2, 2, 2]) == [5, 5, 5, 5]
    assert run("a", [4, 3, 2, 1]) == [9, 7, 5, 3]
    assert graphs.num_captured == 2 and graphs.captures == 3  # "a" twice: the count of captures never drops


@pytest.mark.parametrize("spec", ["no-spec", "eagle3-d3"])
def test_padded_layout_with_the_upload_in_the_step_equals_packed(dirs, spec, monkeypatch):
    """A graph step's record upload is part of the step (captured with it, so a replay makes no copy call from the
    host): the graph key carries the record's size, which the captured copy fixes, and the upload runs inside the
    step function, once per step."""
    ref, _ = _run(dirs, SPECS[spec], 3, padded=False)
    keys, uploads = [], []
    run, graph_batch = CudaGraphs.run, ModelRunner.graph_batch

    def keyed(self, key, step, **kw):
        keys.append(key)
        return run(self, key, step, **kw)

    def batch(self, rec, *args):
        uploads.append((self._ints.host is not None, rec.size))
        return graph_batch(self, rec, *args)

    monkeypatch.setattr(CudaGraphs, "run", keyed)
    monkeypatch.setattr(ModelRunner, "graph_batch", batch)
    got, llm = _run(dirs, SPECS[spec], 3, padded=True)
    assert got == ref
    assert keys and len(uploads) == len(keys)
    assert [k[-1] for k in keys] == [size for _, size in uploads]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_an_upload_captured_in_a_graph_reads_the_host_buffer_at_each_replay():
    from specserve.runner.staging import Staging

    st = Staging(torch.float32, torch.device("cuda"), 16)
    graphs = CudaGraphs(1, [st])

    def step():  # the copy is captured with the step
        st.upload(4)
        return st.dev[:4] * 2 + 1

    def run(values):
        st.reserve(4)[:4] = values
        st.upload_deferred()
        out = graphs.run("k", step).tolist()
        st.synced()
        return out

    assert run([1, 2, 3, 4]) == [3, 5, 7, 9]
    assert run([0, 1, 0, 1]) == [1, 3, 1, 3]  # a replay: no copy call from the host
    assert run([5, 5, 5, 5]) == [11, 11, 11, 11]
    assert graphs.num_captured == 1


def test_a_long_prompts_prefill_graph_is_at_most_a_third_padding():
    sizes = {n: prefill_q(n) for n in (1, 16, 17, 300, 512, 513, 768, 769, 1025, 1536, 1537, 2048, 6000)}
    assert sizes == {1: 16, 16: 16, 17: 32, 300: 512, 512: 512, 513: 768, 768: 768, 769: 1024, 1025: 1536,
                     1536: 1536, 1537: 2048, 2048: 2048, 6000: 6144}
    assert all(prefill_q(n) >= n and (prefill_q(n) - n) * 3 <= prefill_q(n) for n in range(512, 9000))


@pytest.mark.parametrize("spec", list(SPECS), ids=str)
def test_one_row_prefill_runs_in_a_padded_layout_and_equals_packed(dirs, spec):
    """Requests one at a time (batch-1 serving): a prompt's last step is padded up to a power of two of at
    least 16 tokens (prompts around 16 and 32 tokens, chunked prompts whose last chunk starts past 0), one
    longer than ``prefill_graph_tokens`` stays packed; greedy and sampled outputs equal packed steps."""
    prompts = [[(7 * i + 3) % 50 + 1 for i in range(n)] for n in (3, 16, 17, 22, 33, 40)]
    # the 33- and 40-token prompts arrive in chunks; the prompts share their beginnings, which prefix caching would
    # skip: off, so that every prompt is prefilled whole
    kw = dict(max_num_batched_tokens=24, max_num_seqs=4, enable_prefix_caching=False)
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0.8, top_k=20, seed=5, max_tokens=12, ignore_eos=True)]
    outs = {}
    for padded in (False, True):
        llm = LLM(str(dirs / "target"), device="cpu", dtype="float32", **kw,
                  speculative_config=None if SPECS[spec] is None else
                  dict(SPECS[spec], draft_model=str(dirs / SPECS[spec]["draft_model"])))
        runner = llm.engine.runner
        layouts = []
        if padded:
            runner.graphs = CudaGraphs(4, runner._staging_buffers(), capture=False)
            runner.prefill_graph_tokens = 20  # the 22-token prompt stays packed
            pick = runner.graph_layout
            runner.graph_layout = lambda batch: layouts.append(pick(batch)) or layouts[-1]
        outs[padded] = [llm.generate([{"prompt_token_ids": p}], params[i % 2])[0].token_ids
                        for i, p in enumerate(prompts)]
        assert llm.engine.pool.num_free == llm.engine.pool.num_usable
    assert outs[True] == outs[False]
    q_gen = 1 if SPECS[spec] is None else 1 + SPECS[spec]["max_draft_len"]
    prefill_q = [lay.q for lay in layouts if lay is not None and lay.q != q_gen]
    # 3, 16 -> 16; 17 -> 32; 22 packed; 33 = 24 packed + 9 -> 16; 40 = 24 packed + 16 -> 16
    assert prefill_q == [16, 16, 32, 16, 16], prefill_q
    assert layouts.count(None) == 3


@pytest.mark.parametrize("spec", list(SPECS), ids=str)
def test_a_burst_of_prompts_runs_as_one_prefill_layout_and_equals_packed(dirs, spec):
    """Seven prompts of 3-30 tokens arriving together: one prefill layout of 8 rows (a padding row) and 32 tokens a
    row, from position 0 (SDPA's causal path); greedy and sampled outputs equal packed steps."""
    lengths = (5, 9, 14, 7, 11, 30, 3)
    prompts = [[(5 * i + j) % 50 + 1 for i in range(n)] for j, n in enumerate(lengths)]
    params = [SamplingParams(temperature=0, max_tokens=9, ignore_eos=True) if i % 2 == 0 else
              SamplingParams(temperature=0.8, top_k=20, seed=i, max_tokens=9, ignore_eos=True)
              for i in range(len(prompts))]
    outs, layouts = {}, []
    for padded in (False, True):
        llm = LLM(str(dirs / "target"), device="cpu", dtype="float32", max_num_seqs=8, enable_prefix_caching=False,
                  speculative_config=None if SPECS[spec] is None else
                  dict(SPECS[spec], draft_model=str(dirs / SPECS[spec]["draft_model"])))
        runner = llm.engine.runner
        if padded:
            runner.graphs = CudaGraphs(8, runner._staging_buffers(), capture=False)
            pick = runner.graph_layout
            runner.graph_layout = lambda batch: layouts.append(pick(batch)) or layouts[-1]
        outs[padded] = [o.token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
        assert llm.engine.pool.num_free == llm.engine.pool.num_usable
    assert outs[True] == outs[False]
    first = layouts[0]
    assert (first.rows, first.q, first.prefill, first.from_zero) == (8, 32, True, True), first


def test_a_prefill_layout_of_several_rows_pads_to_twice_their_tokens_plus_slack_or_16_a_row(dirs):
    from specserve.core.request import Request
    from specserve.scheduler.scheduler import ScheduledRequest, SchedulerOutput

    llm = LLM(str(dirs / "target"), device="cpu", dtype="float32", max_num_seqs=8)
    runner = llm.engine.runner
    runner.graphs = CudaGraphs(8, runner._staging_buffers(), capture=False)
    sp = SamplingParams(temperature=0, max_tokens=4)

    def rows(*lengths):
        return SchedulerOutput([ScheduledRequest(Request(str(i), None, list(range(1, n + 1)), sp, 4096, ()), 0, n, True)
                                for i, n in enumerate(lengths)])

    lay = runner._prefill_layout(rows(*[20] * 8))  # 8 x 32 = 256 padded for 160
    assert (lay.rows, lay.q, lay.prefill, lay.from_zero) == (8, 32, True, True)
    assert runner._prefill_layout(rows(100, *[2] * 7)) is None  # 8 x 128 = 1,024 padded for 114
    assert runner._prefill_layout(rows(*[2] * 8)).q == 16  # 16 a row, whatever the real tokens
    assert runner._prefill_layout(rows(100, *[80] * 3)).rows == 4  # 4 x 128 = 512 <= 2 x 340 + 256


@pytest.mark.parametrize("spec", list(SPECS), ids=str)
def test_requests_joining_running_ones_run_as_split_graph_steps(dirs, spec):
    """More requests than slots: requests join running ones when slots free. That step runs the new prompts
    as one prefill layout and the running rows as a generation layout (a prompt longer than
    ``prefill_graph_tokens`` keeps the step packed); greedy and sampled outputs equal packed steps."""
    lengths = (5, 9, 14, 7, 11, 30, 6, 12)
    prompts = [[(5 * i + j) % 50 + 1 for i in range(n)] for j, n in enumerate(lengths)]
    max_tokens = (8, 8, 20, 9, 12, 10, 7, 9)  # the first two end together: two prompts join at once
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) if i % 2 == 0 else
              SamplingParams(temperature=0.8, top_k=20, seed=i, max_tokens=m, ignore_eos=True)
              for i, m in enumerate(max_tokens)]
    outs, decisions, split_layouts = {}, [], []
    for padded in (False, True):
        llm = LLM(str(dirs / "target"), device="cpu", dtype="float32", max_num_seqs=3,
                  speculative_config=None if SPECS[spec] is None else
                  dict(SPECS[spec], draft_model=str(dirs / SPECS[spec]["draft_model"])))
        runner = llm.engine.runner
        if padded:
            runner.graphs = CudaGraphs(4, runner._staging_buffers(), capture=False)
            runner.prefill_graph_tokens = 20  # the 30-token prompt joins in a packed step
            step, split, launch = runner.launch, runner._split, runner._launch
            state = {"split": False}

            def spy_step(batch):
                state["split"] = False
                return step(batch)

            def spy_split(batch):
                joining = [s.num_tokens for s in batch.scheduled if not runner._generation_row(s)]
                decisions.append((joining, len(batch.scheduled), split(batch)))
                state["split"] = decisions[-1][2] is not None
                return decisions[-1][2]

            def spy_launch(batch, layout, spec):
                if state["split"]:  # a part of a split step
                    split_layouts.append(layout)
                return launch(batch, layout, spec)
            runner.launch, runner._split, runner._launch = spy_step, spy_split, spy_launch
        outs[padded] = [o.token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
        assert llm.engine.pool.num_free == llm.engine.pool.num_usable
    assert outs[True] == outs[False]
    mixed = [(j, n, g) for j, n, g in decisions if j and len(j) < n]  # prompts joining running rows
    assert len(mixed) >= 3
    for joining, n, groups in mixed:
        if 30 in joining:
            assert groups is None
        else:  # the running rows together, then the joining prompts together in one prefill layout
            assert [len(g) for g in groups] == [n - len(joining), len(joining)], (joining, groups)
    if SPECS[spec] is None:  # without drafts the first two requests end in the same step
        assert any(len(j) == 2 and g is not None for j, _, g in mixed)
    # every part of a split step ran in a graph layout
    assert len(split_layouts) == sum(len(g) for _, _, g in mixed if g is not None)
    assert all(lay is not None for lay in split_layouts)
    if SPECS[spec] is None:  # the two prompts that joined together ran as one two-row prefill layout
        assert any(lay.prefill and lay.rows == 2 for lay in split_layouts)


def test_prefill_layout_keeps_padding_positions_inside_the_context(dirs):
    """A prompt's power-of-two padding must not reach positions past max_model_len (nor the RoPE table):
    with a 40-token context, a 20-token prompt (-> 32) is padded, a 33-token one (-> 64) runs packed (prefix
    caching off: the second prompt begins with the first)."""
    llm = LLM(str(dirs / "target"), device="cpu", dtype="float32", max_model_len=40, enable_prefix_caching=False)
    runner = llm.engine.runner
    runner.graphs = CudaGraphs(4, runner._staging_buffers(), capture=False)
    layouts = []
    pick = runner.graph_layout
    runner.graph_layout = lambda batch: layouts.append(pick(batch)) or layouts[-1]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    for n in (20, 33):
        layouts.clear()
        llm.generate([{"prompt_token_ids": list(range(3, 3 + n))}], params)
        assert (layouts[0] is None) == (n == 33) and (n == 33 or layouts[0].q == 32), (n, layouts[0])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("spec", [False, True], ids=["no-spec", "eagle3-shipped"])
def test_default_model_bf16_graphs_equal_eager_at_padded_batches(spec):
    """The real model in bf16, where a GEMM's row count can pick its cuBLAS kernel and so its rounding: batches
    of 3 and 6 run padded to 4 and 8 rows (a verify step: 20 / 40 rows), captured or not (``enforce_eager``),
    and must give the same tokens. (Packed eager steps of 6 rows gave other tokens after ~27 here, the H200,
    2026-12-02: why ``enforce_eager`` keeps the padded layouts.)"""
    import os

    from specserve.bench.prompts import DEFAULT_PROMPTS
    from specserve.heads import default_speculative_config
    from specserve.loaders import default_model_path

    path = os.environ.get("SPECSERVE_TEST_GGUF") or str(default_model_path())
    sp = SamplingParams(temperature=0, max_tokens=64)
    msgs = [[{"role": "user", "content": p}] for p in DEFAULT_PROMPTS[:6]]
    for n in (3, 6):
        outs = []
        for eager in (True, False):
            llm = LLM(path, device="cuda", dtype="bfloat16", kv_cache_memory_bytes=1 << 28, enforce_eager=eager,
                      speculative_config=default_speculative_config("eagle3") if spec else None)
            outs.append([o.token_ids for o in llm.chat(msgs[:n], sp)])
            assert eager or llm.engine.runner.graphs.num_captured > 0
            del llm
        assert outs[1] == outs[0], n


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pdl_launches_give_the_tokens_of_ordinary_ones(monkeypatch):
    """Programmatic dependent launch (``kernels.pdl``) lets a kernel start before its predecessor completes; a
    read or write issued before its wait would race. The real model in bf16 with the shipped EAGLE-3 head,
    captured graphs, one prompt long enough that attention splits its keys (merged in the o projection): the
    same tokens with PDL as without, at batch 1 and 4."""
    import os

    from specserve.bench.prompts import DEFAULT_PROMPTS
    from specserve.heads import default_speculative_config
    from specserve.kernels import pdl
    from specserve.loaders import default_model_path

    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("PDL needs compute capability 9.0")
    path = os.environ.get("SPECSERVE_TEST_GGUF") or str(default_model_path())
    sp = SamplingParams(temperature=0, max_tokens=96)
    long = " ".join(DEFAULT_PROMPTS) * 3 + " Summarise all of the above."
    msgs = [[{"role": "user", "content": p}] for p in [long] + DEFAULT_PROMPTS[:3]]
    for spec in (None, default_speculative_config("eagle3")):
        outs = {}
        for on in (False, True):
            monkeypatch.setattr(pdl, "ENABLED", on)
            llm = LLM(path, device="cuda", dtype="bfloat16", kv_cache_memory_bytes=1 << 28, speculative_config=spec)
            assert pdl.pdl(llm.engine.model.embed_tokens.weight) == on
            alone = llm.chat(msgs[:1], sp)
            assert len(alone[0].prompt_token_ids) > 512  # attention in splits (kernels.attention_launch.ONE_SPLIT_KEYS)
            outs[on] = [o.token_ids for o in alone] + [o.token_ids for o in llm.chat(msgs, sp)]
            assert llm.engine.runner.graphs.num_captured > 0
            del llm
        assert outs[True] == outs[False], spec is not None
