"""Spec-Bench-style summarization prompts from local prompt files, for ``specserve bench --prompts``.

No corpus of articles can be downloaded here, so each document is built as the development sets build theirs
(``specserve.train.devsets``): sections of real text, the datasets' own responses (never the target's, which the
shipped heads trained on) each headed by its instruction, about ``--doc-tokens`` tokens in all, with a request to
summarize every section. Writes one ``{"messages": [...]}`` record a line.

    python benchmarks/summarization_prompts.py .traindata/gpteacher-*.json --num 32 --out summarize.jsonl
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from specserve.train.devsets import build_dev_sets
from specserve.train.prompts import prompt_of, read_records


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+", help="prompt files with responses (GPTeacher JSON, Alpaca seed tasks)")
    ap.add_argument("--num", type=int, default=32, help="prompts to write")
    ap.add_argument("--doc-tokens", type=int, nargs=2, default=(1000, 2000), metavar=("MIN", "MAX"),
                    help="a document's length in tokens, drawn per document (estimated at 4 characters a token)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    if a.num < 1 or not 0 < a.doc_tokens[0] <= a.doc_tokens[1]:
        ap.error("--num must be >= 1 and --doc-tokens MIN <= MAX, both > 0")
    allowed = {p for f in a.files for p in map(prompt_of, read_records(Path(f))) if p}
    convs = build_dev_sets(a.files, allowed, a.num, a.seed, tuple(a.doc_tokens)).get("summarization")
    if not convs:
        raise SystemExit("the files hold no responses long enough to build documents from")
    with open(a.out, "w") as f:
        for conv in convs:
            f.write(json.dumps({"messages": conv}) + "\n")
    print(f"{len(convs)} summarization prompts -> {a.out}")


if __name__ == "__main__":
    main()
