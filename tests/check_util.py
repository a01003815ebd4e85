"""What every kernel check shares: tolerances, the quick setting, and the wrapper that makes sure the Triton path
runs (``kernel_checks.py``, ``linear_checks.py``)."""

from __future__ import annotations

import functools
import os

import torch

from specserve import kernels
from specserve.kernels import use_triton

TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}
# SPECSERVE_KERNEL_CHECKS=quick: the CPU suite's run through Triton's interpreter, which costs about a second per
# few kernel programs (the full checks take about 40 minutes on 2 cores). Every kernel and each of its branches
# still runs, on fewer heads, features and table positions; the GPU and a full interpreter run take every shape.
QUICK = os.environ.get("SPECSERVE_KERNEL_CHECKS") == "quick"


def kernel_check(fn):
    """Run a check without autograd (the kernels never run while autograd records) and make sure the
    Triton path is the one taken, so a check can never compare a reference with itself."""
    @functools.wraps(fn)
    def run(device, dtype):
        with torch.no_grad():
            assert use_triton(torch.empty(1, device=device)), "the Triton kernels are off for this device"
            fn(device, dtype)
            assert not kernels.FAILED, f"kernels fell back to their references: {sorted(kernels.FAILED)}"
    return run


def _close(a, b, dtype, what):
    a, b = a.float(), b.float()
    err = (a - b).abs().max().item() / max(1.0, b.abs().max().item())
    assert err <= TOL[dtype], f"{what}: max relative error {err:.2e} > {TOL[dtype]:.0e}"
