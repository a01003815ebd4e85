"""The CPU suite's two Triton-interpreter scripts (kernel_checks.py and kernel_engine_check.py, the quick shapes:
check_util.QUICK; the full ones take 40 minutes here, ``TRITON_INTERPRET=1 SPECSERVE_BUILD_SM=90 python
tests/kernel_checks.py cpu`` runs them) as background processes. Each is one Python thread for several minutes on
a 2-core machine (about 4 and 7), so conftest.py starts them as soon as the session has collected the tests that
read them: they then run beside the rest of the suite instead of holding it up while it waits for them. Each also
builds every kernel signature it launched for sm_90 (kernel_build.py): the interpreter runs code that the
compiler rejects."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

# the tests in test_kernels.py that read the runs: conftest starts the runs only where one of them is collected
TESTS = ("test_kernels_match_references_in_triton_interpreter",
         "test_engine_with_triton_kernels_matches_reference_in_interpreter")
SCRIPTS = {"kernels": ("kernel_checks.py", ["cpu"]), "engine": ("kernel_engine_check.py", [])}
TIMEOUT_S = 1500  # from the start: the runs share the machine with the suite
_KEY = pytest.StashKey["Runs"]()


@dataclass
class Runs:
    logs: Path  # the folder of their logs, removed when pytest ends
    procs: dict[str, tuple[subprocess.Popen, Path]] = field(default_factory=dict)  # name -> (process, its log)
    started: float = field(default_factory=time.monotonic)

    def result(self, name: str) -> tuple[int, str]:
        """The script's exit status and output, once it has ended (killed past ``TIMEOUT_S`` from the start)."""
        proc, log = self.procs[name]
        try:
            rc = proc.wait(timeout=max(1.0, TIMEOUT_S - (time.monotonic() - self.started)))
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
            return rc, f"timed out after {TIMEOUT_S} s\n{log.read_text()}"
        return rc, log.read_text()

    def kill(self) -> None:
        for proc, _ in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def start(config: pytest.Config) -> Runs:
    """Start both scripts (output to files: a full pipe would stall a run) and keep them in the session."""
    env = dict(os.environ, TRITON_INTERPRET="1", SPECSERVE_BUILD_SM="90", SPECSERVE_KERNEL_CHECKS="quick",
               OMP_NUM_THREADS="1")  # one thread each: they share two cores with the suite
    here, logs = Path(__file__).parent, Path(tempfile.mkdtemp(prefix="interpreter-"))
    runs = Runs(logs)
    for name, (script, args) in SCRIPTS.items():
        with open(logs / f"{name}.log", "w") as f:
            proc = subprocess.Popen([sys.executable, str(here / script), *args], env=env, stdout=f,
                                    stderr=subprocess.STDOUT)
        runs.procs[name] = (proc, logs / f"{name}.log")
    config.stash[_KEY] = runs
    return runs


def started(config: pytest.Config) -> Runs | None:
    return config.stash.get(_KEY, None)


def stop(config: pytest.Config) -> None:
    runs = started(config)
    if runs is not None:
        runs.kill()
        shutil.rmtree(runs.logs, ignore_errors=True)
