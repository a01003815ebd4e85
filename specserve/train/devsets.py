"""Conversations by category, built from the prompt files at hand: development sets kept apart from training, and
training prompts of the same kinds (``--category-prompts``, from the training records only).

A head's acceptance depends on what users send: short chat, code, long documents to summarize or question,
conversations of several turns, rewriting and extraction over a text, translation, arithmetic word problems. Each
category's set is a list of chat conversations (the last message the user's). Only records whose prompt was never
trained on (a run's held-out prompts, prompts of evaluation-only files) are used:

- records taken as they are, named by their file: chat (GPTeacher roleplay), code (GPTeacher codegen, HumanEval),
  tool-use (GPTeacher toolformer), instructions (Alpaca seed tasks); another file is its own category;
- records' responses (the dataset's, not the target's) turned into tasks: a long document of sections, one per
  response headed by its instruction, to summarize or to answer one section's instruction from (document-qa);
  earlier turns of instruction and response before a new instruction (multi-turn); one response to rewrite, to
  extract names and numbers from, or to translate;
- math: arithmetic word problems from templates and seeded random numbers (development and training sets draw from
  separate halves of the templates).
"""

from __future__ import annotations

import random
from pathlib import Path

from specserve.train.prompts import prompt_of, read_records

# file name part -> category of the records taken as they are
SOURCE_CATEGORIES = (("roleplay", "chat"), ("codegen", "code"), ("humaneval", "code"), ("toolformer", "tool-use"),
                     ("alpaca", "instructions"))
TEXT_CATEGORIES = ("summarization", "document-qa", "multi-turn", "rewriting", "extraction", "translation")
CHARS_PER_TOKEN = 4  # a document's length in tokens, estimated (English text, BPE tokenizers)
MIN_RESPONSE_CHARS = 200  # shorter responses make poor documents and texts to rewrite

_MATH = (
    "A shop sells pencils at {a} cents each and erasers at {b} cents each. Maria buys {c} pencils and {d} erasers. "
    "How much does she pay in dollars? Explain each step.",
    "A train leaves at {a}:00 and travels {b} km at {c} km per hour. At what time does it arrive? Show your work.",
    "A tank holds {a} litres. It is filled at {b} litres per minute and leaks {c} litres per minute. How many "
    "minutes does it take to fill the empty tank? Explain your reasoning.",
    "Tom has {a} marbles. He gives a third of them to Ann, then buys {b} more and loses {c}. How many marbles does "
    "he have now? Solve it step by step.",
    "A rectangle is {a} cm long and {b} cm wide. A square has the same perimeter. What is the square's area? "
    "Show the calculation.",
    "A class of {a} students goes on a trip. Each bus holds {b} students and costs {c} dollars. What does the trip "
    "cost for buses, and how many empty seats are there? Explain.",
)


def category_of(path: str | Path) -> str:
    name = Path(path).name.lower()
    return next((cat for part, cat in SOURCE_CATEGORIES if part in name), Path(path).name.split(".")[0])


def response_of(rec) -> str | None:
    """The dataset's response of a record (GPTeacher ``response``, Alpaca seed tasks' first output), if any."""
    if not isinstance(rec, dict):
        return None
    if isinstance(rec.get("response"), str):
        return rec["response"]
    if isinstance(rec.get("output"), str):
        return rec["output"]
    inst = rec.get("instances")
    return inst[0].get("output") if inst and isinstance(inst[0], dict) else None


def build_dev_sets(files: list[str | Path], allowed: set[str], per_category: int, seed: int = 0,
                   doc_tokens: tuple[int, int] = (1000, 4000), development: bool = True) -> dict[str, list[list[dict]]]:
    """Category -> up to ``per_category`` conversations built from the records of ``files`` whose prompt is in
    ``allowed`` (development sets: never trained on; training's ``--category-prompts``: its training prompts);
    documents of about ``doc_tokens`` tokens (a range, drawn per document). ``development`` False (training) leaves
    out the categories of records taken as they are (training has them already), and draws its math problems from
    the other half of the templates."""
    rng = random.Random(seed)
    prompts: dict[str, dict[str, None]] = {}  # category -> its allowed prompts, once each, in order
    texts: list[tuple[str, str]] = []  # (instruction, response) pairs of allowed records
    for f in files:
        cat = category_of(f)
        for rec in read_records(Path(f)):
            prompt = prompt_of(rec)
            if not prompt or prompt not in allowed:
                continue
            prompts.setdefault(cat, {})[prompt] = None
            resp = response_of(rec)
            if resp and len(resp) >= MIN_RESPONSE_CHARS:
                texts.append((prompt, resp))
    sets: dict[str, list[list[dict]]] = {}
    for cat, ps in prompts.items() if development else ():
        order = list(ps)
        rng.shuffle(order)
        sets[cat] = [[{"role": "user", "content": p}] for p in order[:per_category]]
    if texts:
        for cat in TEXT_CATEGORIES:
            sets[cat] = [_text_task(cat, texts, rng, doc_tokens) for _ in range(per_category)]
    templates = _MATH[0::2] if development else _MATH[1::2]  # no problem of one kind is in both
    sets["math"] = [[{"role": "user", "content": _math(rng, templates)}] for _ in range(per_category)]
    return {k: v for k, v in sets.items() if v}


def _document(texts, rng: random.Random, doc_tokens: tuple[int, int]) -> list[tuple[str, str]]:
    """Sections (instruction, response) drawn until the document reaches its drawn length (at least two)."""
    want = rng.randint(*doc_tokens) * CHARS_PER_TOKEN
    sections, size = [], 0
    while len(sections) < 4 * len(texts):  # few, short texts: the document stays shorter
        sec = texts[rng.randrange(len(texts))]
        if len(sections) >= 2 and size + len(sec[0]) + len(sec[1]) > want:  # not past its length
            break
        sections.append(sec)
        size += len(sec[0]) + len(sec[1])
    return sections


def _text_task(cat: str, texts, rng: random.Random, doc_tokens: tuple[int, int]) -> list[dict]:
    if cat in ("summarization", "document-qa"):
        sections = _document(texts, rng, doc_tokens)
        doc = "\n\n".join(f"## {title.splitlines()[0][:120]}\n\n{body}" for title, body in sections)
        if cat == "summarization":
            ask = "Summarize the document below in a few paragraphs, covering every section."
        else:
            title = sections[rng.randrange(len(sections))][0].splitlines()[0][:120]
            ask = f"Using only the document below, answer the request of the section titled \"{title}\"."
        return [{"role": "user", "content": f"{ask}\n\n{doc}"}]
    if cat == "multi-turn":
        turns = [texts[rng.randrange(len(texts))] for _ in range(rng.randint(2, 3))]
        conv = [m for q, a in turns for m in ({"role": "user", "content": q}, {"role": "assistant", "content": a})]
        return conv + [{"role": "user", "content": texts[rng.randrange(len(texts))][0]}]
    _, text = texts[rng.randrange(len(texts))]
    if cat == "rewriting":
        ask = "Rewrite the text below in plain words that a twelve-year-old would understand, keeping every point."
    elif cat == "extraction":
        ask = "List every name, place, number and date in the text below, one per line, each with what it refers to."
    else:
        text = " ".join(text.split(". ")[:3])
        ask = f"Translate the text below into {rng.choice(('French', 'German', 'Spanish', 'Italian'))}."
    return [{"role": "user", "content": f"{ask}\n\n{text}"}]


def _math(rng: random.Random, templates: tuple[str, ...]) -> str:
    return rng.choice(templates).format(a=rng.randint(3, 60), b=rng.randint(2, 40), c=rng.randint(2, 30),
                                    d=rng.randint(2, 20))
