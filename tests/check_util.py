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


# the names Triton 3.7's ``InterpretedFunction.__call__`` uses: patch, rewrite, call, wrap the error
_DEVICE_CALL_NAMES = ("_patch_lang", "fn", "rewrite", "Exception", "InterpreterError", "repr")


def faster_interpreter_device_calls() -> bool:
    """Under Triton's interpreter, let a call of a ``@triton.jit`` helper from a kernel (``_gemv_weights``,
    ``pdl_wait``, ``tl.max``, ...) patch the ``triton.language`` modules only where they are not patched yet: the
    kernel's launch patches those it sees (their attributes, for the launch), and a helper that sees another (Triton's
    own ``tl.core``) patches that one for good on its first call. Patching again on every call of every program
    (``inspect.getmembers`` over the modules) was about a third of the interpreter scripts' time. Only where the
    interpreter's device call is the one this was written against (it patches, rewrites and calls); else nothing
    changes. -> whether applied."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return False
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return False
    fn = getattr(interpreter, "InterpretedFunction", None)
    names = getattr(getattr(getattr(fn, "__call__", None), "__code__", None), "co_names", ())
    if names != _DEVICE_CALL_NAMES:  # another Triton's device call: it may do more than this replacement
        return False

    def device_call(self, *args, **kwargs):
        langs = [v for v in self.fn.__globals__.values() if v is tl or v is tl.core]
        if any(tl.core.is_builtin(lang.program_id) for lang in langs) or not langs:
            interpreter._patch_lang(self.fn)
        rewritten = self.rewrite()
        try:
            return rewritten(*args, **kwargs)
        except Exception as e:
            raise interpreter.InterpreterError(repr(e)) from e

    fn.__call__ = device_call
    return True
