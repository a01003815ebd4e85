"""Registers and spills of the several-row kernels built for sm_90, at the default model's width and wider ones,
on a machine without a GPU: the launches run through Triton's interpreter once (recording their signatures, as
``tests/kernel_build.py`` does), then each is compiled for sm_90 with programmatic dependent launch and Triton's
bundled ``ptxas -v`` reports what it used. These are the figures behind ``gemv_rows.fits``.

    python benchmarks/kernel_spills.py        (CPU; re-runs itself under TRITON_INTERPRET=1 to record)
"""

from __future__ import annotations

import importlib
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

WIDTHS = (576, 960, 1536, 2048)  # SmolLM2-135M, -360M, and wider models' hidden sizes


def record(path: str) -> None:
    """Launch each kernel once per width in the interpreter (float16 tensors, recorded as bfloat16)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    import torch

    import kernel_build
    from specserve.kernels import gemv_rows
    from specserve.kernels.gemv import ADD_NORM
    from specserve.kernels.qkv_rope import _qkv_rows

    launched = kernel_build.record(("bf16",))
    gemv_rows.fits = lambda *a: True  # build the launches that the engine leaves to other kernels too
    t, hq, hkv, d = 5, 9, 3, 64
    for k in WIDTHS:
        x, res, nw = torch.randn(t, k).half(), torch.randn(t, k).half(), torch.ones(k).half()
        # gate/up's default launch, 32 features / 2 warps (a few output features: the build depends on K only)
        gemv_rows.rows_linear(x, torch.randn(64, k).half(), block=32, num_warps=2)
        cache = torch.zeros(4, 16, hkv, d).half()
        freqs = torch.randn(16, d // 2)
        _qkv_rows(x, torch.randn((hq + 2 * hkv) * d, k).half(), None, ADD_NORM, res, nw, 1e-5, torch.arange(t), freqs,
                  freqs, cache, cache.clone(), torch.arange(t), hq, hkv, d, setting=(16, 4))
    json.dump(launched, open(path, "w"))


def build(path: str) -> None:
    """Compile each recorded launch for sm_90 and print ptxas's registers and spills."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.compiler import ASTSource

    ptxas = get_ptxas(90).path
    for e in json.load(open(path)):
        e["consts"]["PDL"], e["options"]["launch_pdl"] = True, True
        kernel = getattr(importlib.import_module(e["module"]), e["name"])
        compiled = triton.compile(ASTSource(kernel, e["signature"], e["consts"]), target=GPUTarget("cuda", 90, 32),
                                  options=e["options"])
        with tempfile.TemporaryDirectory() as tmp:
            ptx = Path(tmp) / "k.ptx"
            ptx.write_text(compiled.asm["ptx"])
            out = subprocess.run([ptxas, "-arch=sm_90a", "-v", str(ptx), "-o", str(Path(tmp) / "k.cubin")],
                                 capture_output=True, text=True).stderr
        regs = re.search(r"Used (\d+) registers", out)
        spill = re.search(r"(\d+) bytes spill stores", out)
        c = e["consts"]
        launch = f"{c['BLOCK_N']} features" if "BLOCK_N" in c else f"{c['HB']} pairs"
        print(f"{e['name']:18s} K={c['K']:5d} ({c['K1']}+{c['K2']}) {launch}, {e['options'].get('num_warps')} warps: "
              f"{regs.group(1) if regs else '?'} registers, {spill.group(1) if spill else '?'} bytes spilled a thread",
              flush=True)


if __name__ == "__main__":
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        path = f.name
    env = dict(os.environ, TRITON_INTERPRET="1")
    subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
                    f"import kernel_spills; kernel_spills.record({path!r})"], env=env, check=True)
    build(path)
    os.unlink(path)
