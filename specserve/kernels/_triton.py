"""The one place the kernels import Triton.

Triton is a declared dependency on Linux (x86_64 and aarch64), where PyPI has wheels; elsewhere the engine runs
its PyTorch references and ``HAVE_TRITON`` is False. A kernel module that is used anyway without Triton then
raises ``ModuleNotFoundError`` naming the fix, instead of an ``AttributeError`` on ``None``.
"""

from __future__ import annotations

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:
    HAVE_TRITON = False

    class _Missing:
        """Stands in for the ``triton`` and ``triton.language`` modules where Triton is not installed."""

        def __init__(self, name: str):
            self._name = name

        def __getattr__(self, attr: str):
            raise ModuleNotFoundError(
                f"{self._name}.{attr}: specserve's Triton kernels need the 'triton' package, which is not "
                "installed. On Linux it is a dependency of specserve (pip install -e . brings it; or pip install "
                "triton); on other platforms the engine runs its PyTorch path and never reaches this code.",
                name="triton")

    triton = _Missing("triton")
    tl = _Missing("triton.language")

__all__ = ["HAVE_TRITON", "triton", "tl"]
