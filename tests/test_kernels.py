"""Triton kernels == their PyTorch references on random inputs (``kernel_checks.py``): on the GPU machine, and
on the CPU through Triton's interpreter (Triton is a dependency wherever PyPI has a wheel for it)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import interpreter_scripts
import kernel_checks

from specserve.kernels._triton import HAVE_TRITON as HAS_TRITON


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or not HAS_TRITON, reason="needs CUDA and Triton")
@pytest.mark.parametrize("dtype", kernel_checks.dtypes("cuda"), ids=str)
@pytest.mark.parametrize("check", kernel_checks.CHECKS, ids=lambda c: c.__name__)
def test_kernel_matches_reference_on_gpu(check, dtype):
    check("cuda", dtype)


@pytest.fixture(scope="module")
def interpreter_runs(request):
    """Both interpreter scripts (``interpreter_scripts.start``: started by conftest.py as soon as the session has
    collected these tests, so that they run beside the rest of the suite; started here when they were not),
    waited for; killed at the end if still running."""
    runs = interpreter_scripts.started(request.config) or interpreter_scripts.start(request.config)
    yield runs.result
    runs.kill()


@pytest.mark.skipif(not HAS_TRITON, reason="no Triton wheel for this platform")
def test_kernels_match_references_in_triton_interpreter(interpreter_runs):
    rc, out = interpreter_runs("kernels")
    assert rc == 0, out
    assert out.count(": ok") == len(kernel_checks.CHECKS) * 2
    assert "built for sm_90" in out, out[-2000:]


@pytest.mark.skipif(not HAS_TRITON, reason="no Triton wheel for this platform")
def test_engine_with_triton_kernels_matches_reference_in_interpreter(interpreter_runs):
    """Eight runs (the quick set: the padded plain layout, the norm folded with gate/up and qkv on the several-row
    kernels and without them, a draft vocabulary, attention in splits merged by the o projection, the overlap
    scheduler with a chain, with a draft tree and with a chain whose draft length changes every step, three steps
    of D = 0 in a row among them, the third a plain step); without SPECSERVE_KERNEL_CHECKS=quick the script runs
    twelve."""
    rc, out = interpreter_runs("engine")
    assert rc == 0, out
    assert out.count(": ok") == 8
    assert "built for sm_90" in out, out[-2000:]


def test_a_kernel_that_does_not_build_falls_back_to_its_reference(monkeypatch, caplog):
    """A Triton kernel that fails to build on a machine (a Triton version's limits, say) must not break the
    engine: the caller runs the PyTorch reference, warns once, and the kernel checks then fail."""
    from specserve import kernels
    from specserve.kernels import step_inputs

    class Broken:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                raise RuntimeError("no such instruction")
            return launch

    monkeypatch.setattr(step_inputs, "use_triton", lambda x: True)
    monkeypatch.setattr(step_inputs, "_expand_record_kernel", Broken(), raising=False)
    monkeypatch.setattr(step_inputs, "triton", type("T", (), {"next_power_of_2": staticmethod(lambda n: n)}))
    monkeypatch.setattr(kernels, "FAILED", set())
    args = (torch.tensor([3, 0]), torch.tensor([2, 1]), torch.tensor([1, 0]), torch.tensor([[5, 6], [0, 0]]),
            torch.tensor([[1, 2], [0, 0]]), 16)
    with caplog.at_level("WARNING", logger="specserve"):
        got = step_inputs.expand_record(*args, draft_len=1, flags=torch.ones(4, 2, dtype=torch.int64))
        step_inputs.expand_record(*args)
    ref = step_inputs.expand_record_ref(*args, draft_len=1, flags=torch.ones(4, 2, dtype=torch.int64))
    assert all(torch.equal(got[k], ref[k]) for k in ref)
    assert kernels.FAILED == {"expand_record"}
    assert sum("expand_record failed to build" in r.message for r in caplog.records) == 1


def test_pdl_launches_only_on_a_gpu_that_has_it(monkeypatch):
    """Programmatic dependent launch is a launch option of CUDA devices of compute capability 9.0+; never for a
    CPU tensor (the interpreter's), never with SPECSERVE_PDL=0 (``ENABLED``). Its kernels' PDL variants are
    built for sm_90 by the interpreter checks above (kernel_build.py), and run on the GPU by
    test_cuda_graph.py::test_pdl_launches_give_the_tokens_of_ordinary_ones."""
    from specserve.kernels import pdl

    assert not pdl.pdl(torch.empty(1))
    assert pdl.launch(False) == {} and pdl.launch(True) == {"launch_pdl": True}
    if torch.cuda.is_available():
        x = torch.empty(1, device="cuda")
        assert pdl.pdl(x) == (pdl._HAS_GDC and torch.cuda.get_device_capability() >= (9, 0) and pdl.ENABLED)
        monkeypatch.setattr(pdl, "ENABLED", False)
        assert not pdl.pdl(x)


@pytest.mark.skipif(not HAS_TRITON, reason="no Triton wheel for this platform")
def test_several_row_kernels_keep_to_widths_that_fit_their_registers():
    """The kernels that read each weight block once for all of a step's rows hold a block of weights and the rows'
    tile in registers: at the default model's width (576) their launches are the ones measured on the GPU, at
    wider inputs they spilled kilobytes a thread (``benchmarks/kernel_spills.py``, sm_90), so those steps keep
    the other kernels (``gemv_rows.fits``). The qkv launch at 960 spills 60 bytes and stays."""
    from specserve.kernels.gemv_rows import fits

    assert fits(576, 32, 2) and not fits(960, 32, 2) and not fits(2048, 32, 2)  # gate/up: 32 features, 2 warps
    assert fits(576, 32, 4) and fits(960, 32, 4) and not fits(1536, 32, 4)  # qkv: 16 pairs (32 rows), 4 warps


@pytest.mark.skipif(not HAS_TRITON, reason="no Triton wheel for this platform")
def test_merged_o_projection_of_several_rows_takes_wider_programs():
    """Each program of the o projection that merges an attention step's splits merges its row again, so steps of
    several rows take twice the features per program of other projections (fewer merges), one-row steps keep
    theirs, and a program never covers more than the padded output width."""
    from specserve.kernels import gemv

    assert gemv.merge_block_n(576, 576, 5) == 2 * gemv.block_n(576, 576, 5) == 16  # the default model's verify
    assert gemv.merge_block_n(576, 576, 1) == gemv.block_n(576, 576, 1)
    assert gemv.merge_block_n(40, 96, 5) == 64 == gemv.block_n(40, 96, 5)  # already the whole output


def test_attention_splits_keys_unless_the_partial_sums_would_be_too_large():
    """A decode or verify step splits its keys over many programs (flash-decoding; their partial sums merged
    after), at batch 1 and at batch 64, with the default model's 3 KV heads or Llama-3.1-8B's 8, at every draft
    length; a step whose partial sums (rows x query tiles x KV heads x splits) would pass MAX_PARTIALS takes one
    split; a short table splits only for a small decode or verify step whose o projection merges the splits (at
    most as many splits as that merge takes). A train-draft regeneration's prefill of 137 prompts of up to 3,114
    tokens asked the H200 for 45.7 GiB of them."""
    from specserve.kernels import gemv
    from specserve.kernels.attention_launch import (MAX_PARTIALS, ONE_SPLIT_KEYS, SHORT_SPLIT, SPLIT, TREE_MIN_SPLITS,
                                                    default_splits, launch_shape, partial_bytes, query_tiling)

    def splits(rows: int, qw: int, hq: int, hkv: int, head_d: int, keys: int) -> int:
        return launch_shape(rows, qw, hq // hkv, hkv, head_d, keys)[3]  # as paged_attention_triton launches

    assert query_tiling(1 + 4, 9 // 3) == (16, 5, 1)  # the default model's verify step: one tile a row
    assert query_tiling(1 + 16, 32 // 8) == (64, 16, 2)  # 8B shapes at D = 16: two
    assert splits(1, 1, 9, 3, 64, ONE_SPLIT_KEYS) == 1  # a short table: one program covers it
    assert splits(1, 1, 9, 3, 64, 8192) == 8192 // SPLIT  # batch 1 decode over a long table
    for d in (1, 4, 16):  # every draft length, batch 64
        assert splits(64, 1 + d, 9, 3, 64, 8192) > 1  # the default model
        assert splits(64, 1 + d, 32, 8, 128, 4096) > 1  # 8B shapes
    assert splits(64, 1, 32, 8, 128, 16384) > 1  # 8B batch-64 decode at 16k positions
    assert splits(137, 3114, 9, 3, 64, 3120) == 1  # the regeneration's prefill: no partial sums
    assert splits(1, 512, 9, 3, 64, 1024) > 1  # a batch-1 prefill chunk splits as before
    # a short table splits where the o projection merges the splits (split_short): small decode and verify steps
    short = launch_shape(1, 1 + 4, 3, 3, 64, ONE_SPLIT_KEYS, split_short=True)[3]
    assert short == ONE_SPLIT_KEYS // SHORT_SPLIT == 4  # the default model's batch-1 verify at 256 positions
    assert launch_shape(1, 1, 3, 3, 64, 128, split_short=True)[3] == 2  # decode over a shorter (eager) table
    assert launch_shape(64, 1 + 4, 3, 3, 64, 256, split_short=True)[3] == 1  # 192 programs fill the GPU anyway
    assert launch_shape(1, 300, 3, 3, 64, 256, split_short=True)[3] == 1  # a prefill chunk: tiles of 64 rows
    assert launch_shape(1, 1 + 4, 3, 3, 64, 512, split_short=True) == launch_shape(1, 1 + 4, 3, 3, 64, 512)
    assert launch_shape(1, 1, 3, 3, 64, 176, split_short=True)[3] == 3  # a packed step's table: 64-key splits
    assert ONE_SPLIT_KEYS // SHORT_SPLIT <= gemv.MERGE_MAX_SPLITS  # the o projection merges every short split
    # a draft tree's verify rows (24 nodes + the root, the tree mask): 16-row tiles, at least 8 splits past 256
    # positions, which the o projection still merges; its prompt chunks keep 64-row tiles
    assert launch_shape(1, 25, 3, 3, 64, 512, split_short=True, tree=True) == (16, 5, 5, TREE_MIN_SPLITS)
    assert launch_shape(1, 25, 3, 3, 64, 512, split_short=True) == (64, 21, 2, 4)
    assert launch_shape(1, 25, 3, 3, 64, 256, split_short=True, tree=True)[:3] == (16, 5, 5)
    assert launch_shape(1, 512, 3, 3, 64, 1024, tree=True) == launch_shape(1, 512, 3, 3, 64, 1024)
    assert launch_shape(1, 25, 3, 3, 64, 512, tree=True, block_m=64) == launch_shape(1, 25, 3, 3, 64, 512)
    assert launch_shape(32, 25, 3, 3, 64, 512, tree=True) == launch_shape(32, 25, 3, 3, 64, 512)  # not measured
    assert TREE_MIN_SPLITS <= gemv.MERGE_MAX_SPLITS
    tile = partial_bytes(16, 64)
    assert default_splits(1024, MAX_PARTIALS // (4 * tile), tile) == 4
    assert default_splits(1024, MAX_PARTIALS // (4 * tile) + 1, tile) == 1


def test_kernel_code_without_triton_says_how_to_install_it():
    """Where Triton is missing, the kernel modules still import (the engine runs their PyTorch references) and
    a kernel helper reached anyway raises ModuleNotFoundError naming the package, not AttributeError on None."""
    code = ("import sys; sys.modules['triton'] = None; sys.modules['triton.language'] = None\n"
            "from specserve.kernels import gemv, use_triton, triton_available\n"
            "import torch\n"
            "assert not triton_available() and not use_triton(torch.zeros(1))\n"
            "try:\n"
            "    gemv.k_blocks(576)\n"
            "except ModuleNotFoundError as e:\n"
            "    print('raised:', e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "raised: triton.next_power_of_2" in out.stdout and "pip install" in out.stdout, out.stdout
