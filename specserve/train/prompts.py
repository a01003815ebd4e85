"""Prompt files in the shapes people have: JSONL or JSON (optionally .gz) with one of
``{"prompt"}``, ``{"instruction", "input"}`` (Alpaca / GPTeacher; Alpaca seed tasks' ``instances`` too),
``{"turns": [...]}`` (MT-bench: the first turn), ShareGPT ``{"conversations": [{"from"|"role", "value"|"content"}]}``
(the first human turn), ``{"messages": [...]}`` (OpenAI chat: the first user turn), or plain strings."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from specserve.tokenizer import chat_message


def _open(path: Path):
    # utf-8-sig: a byte-order mark (some Windows editors write one) is not part of the first record
    if path.suffix.lower() == ".gz":
        return gzip.open(path, "rt", encoding="utf-8-sig")
    return open(path, encoding="utf-8-sig")


def read_records(path: Path) -> list:
    with _open(path) as f:
        text = f.read()
    stripped = text.lstrip()
    if stripped.startswith("["):
        return json.loads(text)
    if stripped.startswith("{"):  # one JSON object over several lines (a pretty-printed .json)
        try:
            return [json.loads(text)]
        except json.JSONDecodeError:
            pass  # JSONL: one object per line
    records = []
    for n, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not valid JSON ({e.msg})") from None
    return records


def _first_user_turn(turns: list) -> str | None:
    """The first non-empty user turn; a turn's content may be a string or OpenAI's text parts."""
    for t in turns:
        if isinstance(t, str) and t.strip():
            return t
        if not isinstance(t, dict) or t.get("from", t.get("role")) not in ("human", "user"):
            continue
        try:
            text = chat_message({"role": "user", "content": t.get("value", t.get("content"))})["content"]
        except ValueError:
            continue  # images and other parts: not a text prompt
        if text.strip():
            return text
    return None


def prompt_of(rec) -> str | None:
    """The user prompt of one record, or None when the record has none."""
    if isinstance(rec, str):
        return rec
    if not isinstance(rec, dict):
        return None
    if isinstance(rec.get("prompt"), str):
        return rec["prompt"]
    if isinstance(rec.get("instruction"), str):
        extra = rec.get("input")
        if extra is None and rec.get("instances"):
            extra = rec["instances"][0].get("input")
        return rec["instruction"] + (f"\n\n{extra}" if extra else "")
    for key in ("turns", "conversations", "messages"):
        if isinstance(rec.get(key), list):
            return _first_user_turn(rec[key])
    return None


def read_prompts(paths: list[str | Path]) -> list[str]:
    """All prompts of the files, in order, without empty or duplicate prompts."""
    out, seen = [], set()
    for p in paths:
        path = Path(p)
        if not path.is_file():
            raise ValueError(f"prompt file {str(p)!r} not found")
        recs = read_records(path)
        found = 0
        for rec in recs:
            text = prompt_of(rec)
            if text and text.strip() and text not in seen:
                seen.add(text)
                out.append(text)
                found += 1
        if not found:
            raise ValueError(f"{path}: no prompts found (expected records with 'prompt', 'instruction', "
                             "'turns', 'conversations' or 'messages')")
    return out
