"""Triton kernels for the CUDA path, each with the PyTorch code it replaces as its tested reference.

The model calls the functions below; they pick the Triton kernel when the tensors live on a CUDA device
and Triton is importable (``SPECSERVE_TRITON=0`` turns them off), and the PyTorch reference otherwise
(the CPU, where the losslessness tests run). ``tests/test_kernels.py`` compares each kernel with its
reference on random inputs (on the GPU machine, or on the CPU through Triton's interpreter).
"""

from __future__ import annotations

import functools
import logging
import os

import torch

log = logging.getLogger("specserve")
FAILED: set[str] = set()  # kernels that did not build on this machine (their callers run the reference)
# The debugging variables (README.md, "Debugging variables"), read here only, once: SPECSERVE_TRITON=0 runs every
# kernel's PyTorch reference (to tell a kernel bug from a model one), SPECSERVE_PDL=0 launches every kernel the
# ordinary way, without programmatic dependent launch (``pdl.py``)
TRITON_OFF = os.environ.get("SPECSERVE_TRITON") == "0"
PDL_OFF = os.environ.get("SPECSERVE_PDL") == "0"


@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    if TRITON_OFF:
        return False
    from specserve.kernels._triton import HAVE_TRITON

    return HAVE_TRITON


def use_triton(x: torch.Tensor) -> bool:
    """Run the Triton kernel for tensors like ``x`` (CUDA, or the CPU under TRITON_INTERPRET=1).

    Never while autograd records (training a head): the kernels have no backward."""
    if not triton_available() or torch.is_grad_enabled():
        return False
    return x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


def kernel_usable(name: str) -> bool:
    """False once ``name`` failed to build here (see ``kernel_failed``)."""
    return name not in FAILED


def kernel_failed(name: str, err: Exception) -> None:
    """A kernel the local Triton could not compile or launch: warn once; its caller falls back to the PyTorch
    reference, so the engine keeps working (slower). The kernel checks fail if this ever happened."""
    if name not in FAILED:
        log.warning("Triton kernel %s failed to build (%s: %s); using its PyTorch reference", name,
                    type(err).__name__, str(err).splitlines()[0] if str(err) else "")
    FAILED.add(name)
