"""Build every Triton kernel that Triton's interpreter launches for a real GPU target as well, on a machine
without one: Triton's front end, its NVIDIA back end and the bundled ptxas run on the CPU. The interpreter
executes a kernel as Python, so it accepts code the compiler rejects (one name typed differently in the two
branches of a runtime ``if``, for instance); this catches that before a GPU call does.

``record()`` notes every distinct signature the interpreter launches; ``build_recorded`` then compiles them
for the GPU in a separate process and raises ``BuildError`` naming each kernel the compiler rejects."""

from __future__ import annotations

import inspect

import torch

_DTYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.int64: "i64",
           torch.int32: "i32", torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8", torch.bool: "i1"}
_OPTIONS = ("num_warps", "num_stages")


class BuildError(AssertionError):
    """A recorded kernel signature that Triton's compiler rejects for the GPU target."""


def _arg_type(value, half: str) -> str:
    if isinstance(value, torch.Tensor):
        t = _DTYPES[value.dtype]
        return "*" + (half if t == "fp16" else t)
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -2 ** 31 <= value < 2 ** 31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"cannot type a kernel argument of {type(value).__name__}")


def record(halves: tuple[str, ...] = ("fp16", "bf16")) -> list[dict]:
    """Wrap the interpreter's launch so that each distinct kernel signature it runs is recorded, float16
    tensors as each of ``halves`` (bfloat16 is what the interpreter cannot run); returns the list that
    collects them."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    seen: list[dict] = []
    params_of: dict = {}
    run = InterpretedFunction.run

    def note(self, args, kwargs):
        params = inspect.signature(self.fn).parameters
        bound = dict(zip(params, args))
        bound.update({k: v for k, v in kwargs.items() if k in params})
        for name, p in params.items():
            if name not in bound and p.default is not inspect.Parameter.empty:
                bound[name] = p.default
        if self.fn not in params_of:
            params_of[self.fn] = {p.name for p in JITFunction(self.fn).params if p.is_constexpr}
        # constexpr parameters, and None arguments (Triton specializes those as constants too)
        consts = {n: bound[n] for n in params if n in params_of[self.fn] or bound.get(n, 0) is None}
        options = {k: kwargs[k] for k in _OPTIONS if k in kwargs}
        half_run = any(isinstance(v, torch.Tensor) and v.dtype == torch.float16 for v in bound.values())
        for half in halves if half_run else halves[:1]:
            entry = dict(module=self.fn.__module__, name=self.fn.__name__, consts=consts, options=options,
                         signature={n: "constexpr" if n in consts else _arg_type(bound[n], half) for n in params})
            if entry not in seen:
                seen.append(entry)

    def run_and_note(self, *args, grid, warmup, **kwargs):
        if not warmup:
            note(self, args, kwargs)
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = run_and_note
    return seen


def build_recorded(entries: list[dict], capability: int) -> None:
    """Compile each recorded signature for the GPU (in a process that is not interpreting: TRITON_INTERPRET
    turns Triton's own library functions into interpreted ones, which the compiler cannot use)."""
    import json
    import os
    import subprocess
    import sys
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(entries, f)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, __file__, f.name, str(capability)], env=env, capture_output=True,
                       text=True)
    os.unlink(f.name)
    print(r.stdout, end="", flush=True)
    if r.returncode:
        raise BuildError(r.stdout[-3000:] + r.stderr[-3000:])


def _build_main(path: str, capability: int) -> int:
    import importlib
    import json

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", capability, 32)
    bad = 0
    entries = json.load(open(path))
    # the interpreter never launches with programmatic dependent launch (kernels.pdl): build those variants too
    entries += [dict(e, consts=dict(e["consts"], PDL=True), options=dict(e["options"], launch_pdl=True))
                for e in entries if e["consts"].get("PDL") is False and capability >= 90]
    for e in entries:
        kernel = getattr(importlib.import_module(e["module"]), e["name"])
        try:
            triton.compile(ASTSource(kernel, e["signature"], e["consts"]), target=target, options=e["options"])
        except Exception as err:
            bad += 1
            print(f"{e['name']} does not build for sm_{capability} ({e['consts']}): {err}")
    print(f"built for sm_{capability}: {len(entries) - bad} of {len(entries)} kernel signatures")
    return 1 if bad else 0


if __name__ == "__main__":
    import sys

    sys.exit(_build_main(sys.argv[1], int(sys.argv[2])))
