"""benchmarks/python_stubs.py: prompts in HumanEval's shape from Python sources (the run-10 head's code data)."""

import gzip
import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "python_stubs.py"
DOC = "Return the running total of the numbers given, one entry per number in the input list."

SOURCE = f'''
from typing import List, Set


def running_total(xs: List[int], settings: Settings = None) -> List[int]:
    """{DOC}"""
    return xs


def has_close_elements(numbers: List[float], threshold: float) -> bool:
    """{DOC}"""
    return False


def no_typing(values: Settings) -> Setter:
    """{DOC}"""
    return values


def _private(x):
    """{DOC}"""


class Box:
    def unique(self, items) -> Set[int]:
        """{DOC}"""
        return set(items)
'''


def test_stubs_keep_signature_and_docstring_only(tmp_path):
    root = tmp_path / "tests_root_named_test"  # the root's own name may hold "test": only paths under it count
    (root / "pkg").mkdir(parents=True)
    (root / "pkg" / "mod.py").write_text(SOURCE)
    (root / "pkg" / "tests").mkdir()
    (root / "pkg" / "tests" / "mod_again.py").write_text(SOURCE.replace("running_total", "skipped_total"))
    exclude = tmp_path / "he.jsonl"
    exclude.write_text(json.dumps({"prompt": "def has_close_elements(numbers, threshold):\n    pass\n"}) + "\n")
    out = tmp_path / "stubs.jsonl.gz"
    subprocess.run([sys.executable, str(SCRIPT), str(root), "--out", str(out), "--exclude", str(exclude)],
                   check=True, capture_output=True)
    with gzip.open(out, "rt") as f:
        stubs = {json.loads(line)["prompt"].split("def ", 1)[1].split("(")[0]: json.loads(line)["prompt"]
                 for line in f}
    # HumanEval's names, private functions and files under a test folder are left out; methods are kept
    assert sorted(stubs) == ["no_typing", "running_total", "unique"]
    for s in stubs.values():
        assert DOC in s and "return " not in s  # no body of the source reaches the prompt
    assert stubs["running_total"].startswith("from typing import List\n")  # not Set for "Settings"
    assert "from typing" not in stubs["no_typing"]
    assert stubs["unique"].startswith("from typing import Set\n")
