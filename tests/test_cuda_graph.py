"""CUDA-graph steps: fixed padded layouts (dummy rows, padded draft slots) give the same outputs as packed eager
steps. On the CPU the padded layout runs without capture (``CudaGraphs(capture=False)``); on the GPU machine
graphs are captured and replayed and must equal ``enforce_eager=True``."""

from __future__ import annotations

import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.runner.cuda_graph import CudaGraphs, capture_sizes
from tiny_models import PROMPTS, make_head, make_hf_model


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("graphs")
    make_hf_model(root / "target", "llama", initializer_range=0.4, num_hidden_layers=4)
    make_head(root / "eagle3", root / "target", "eagle3", own_head=False, seed=1)
    make_head(root / "mtp", root / "target", "mtp", num_modules=1, seed=2)
    return root


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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("spec", list(SPECS), ids=str)
@pytest.mark.parametrize("dtype,backend", [("float32", "auto"), ("bfloat16", "auto"), ("float32", "sdpa")])
def test_cuda_graphs_equal_eager(dirs, spec, dtype, backend):
    """Both attention backends: SDPA's mask must be built inside the captured step, not reused from it."""
    for n in (1, 3, 6):
        kw = dict(device="cuda", dtype=dtype, attention_backend=backend)
        ref, _ = _run(dirs, SPECS[spec], n, padded=False, enforce_eager=True, **kw)
        got, llm = _run(dirs, SPECS[spec], n, padded=False, **kw)
        assert llm.engine.runner.graphs.num_captured > 0
        assert got == ref, (spec, dtype, backend, n)
