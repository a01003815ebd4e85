"""Triton kernels == their PyTorch references on random inputs (``kernel_checks.py``): on the GPU machine, and
on the CPU through Triton's interpreter when Triton is installed (it is not a CPU dependency of the project)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kernel_checks

HAS_TRITON = importlib.util.find_spec("triton") is not None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or not HAS_TRITON, reason="needs CUDA and Triton")
@pytest.mark.parametrize("dtype", kernel_checks.dtypes("cuda"), ids=str)
@pytest.mark.parametrize("check", kernel_checks.CHECKS, ids=lambda c: c.__name__)
def test_kernel_matches_reference_on_gpu(check, dtype):
    check("cuda", dtype)


@pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed (CPU CI); the GPU test covers the kernels")
def test_kernels_match_references_in_triton_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    here = Path(__file__).parent
    r = subprocess.run([sys.executable, str(here / "kernel_checks.py"), "cpu"], env=env, capture_output=True,
                       text=True, timeout=900)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count(": ok") == len(kernel_checks.CHECKS) * 2


@pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed (CPU CI); the GPU tests cover the kernels")
def test_engine_with_triton_kernels_matches_reference_in_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, str(Path(__file__).parent / "kernel_engine_check.py")], env=env,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count(": ok") == 4
