"""The data a draft head trains on: the prompt files' train / held-out split, earlier runs' regenerated data
(``data.pt`` files) combined without training on another file's held-out prompts, and padded batches."""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path

import torch

from specserve.train.config import TrainConfig
from specserve.train.prompts import read_prompts

log = logging.getLogger("specserve")


def split_prompts(cfg: TrainConfig) -> tuple[list[str], list[str]]:
    prompts = read_prompts(cfg.prompts)
    rng = random.Random(cfg.seed)
    rng.shuffle(prompts)
    if cfg.max_prompts:
        prompts = prompts[:cfg.max_prompts]
    n_hold = max(1, int(len(prompts) * cfg.holdout)) if cfg.holdout > 0 and len(prompts) > 1 else 0
    return prompts[n_hold:], prompts[:n_hold]


def load_data(paths: list[str]) -> dict:
    """Regenerated data of earlier runs (``data.pt`` each), combined: e.g. greedy and sampled responses to
    the same prompts, or responses to synthesized prompts. No file may have trained on a prompt that another
    holds out: a file that lists its training prompts must avoid every held-out prompt; one that does not
    (older files) must hold out exactly the union of the held-out prompts."""
    files = []
    for p in paths:
        if not Path(p).is_file():
            raise ValueError(f"--data {p}: no such file")
        files.append(torch.load(p))
        log.info("loaded %d regenerated sequences from %s", len(files[-1]["train"]), p)
    held: list[str] = []  # every file's held-out prompts, once each, in order
    union: set[str] = set()
    for d in files:
        for h in d.get("holdout_prompts") or []:
            if h.strip() not in union:
                union.add(h.strip())
                held.append(h)
    for p, d in zip(paths, files):
        if "train_prompts" in d:
            clash = union.intersection(prompt_key(p) for p in d["train_prompts"])
            if clash:
                raise ValueError(f"--data {p} trained on {len(clash)} prompt(s) another file holds out, e.g. "
                                 f"{next(iter(clash))[:60]!r}")
        elif {h.strip() for h in d.get("holdout_prompts") or []} != union:
            raise ValueError(f"--data {p}: its held-out prompts differ from the other files' (regenerate with the "
                             "same prompt files, --holdout and --seed; --gen-seed changes the sampling only)")
    return {"train": [s for d in files for s in d["train"]], "holdout_prompts": held,
            "train_prompts": [p for d in files for p in d.get("train_prompts") or []],
            "gen_seconds": sum(d.get("gen_seconds") or 0.0 for d in files)}


def prompt_key(p) -> str:
    """A training prompt (a user message, or a conversation: a list of messages) as a comparable string."""
    return p.strip() if isinstance(p, str) else json.dumps(p)


def sample_batch(rng: random.Random, seqs: list[dict], batch_size: int, batch_tokens: int, max_len: int) -> list[int]:
    """Indices of a step's sequences, drawn with replacement: ``batch_size`` of them, or with ``batch_tokens``
    fewer where the batch padded to its longest sequence (cut to ``max_len``) would pass that many tokens (at
    least one)."""
    idx: list[int] = []
    longest = 0
    while len(idx) < batch_size:
        i = rng.randrange(len(seqs))
        n = min(max_len, len(seqs[i]["prompt_ids"]) + len(seqs[i]["response_ids"]))
        if batch_tokens and idx and (len(idx) + 1) * max(longest, n) > batch_tokens:
            break
        idx.append(i)
        longest = max(longest, n)
    return idx


def make_batch(data: list[dict], idx: list[int], max_len: int, device) -> tuple[torch.Tensor, ...]:
    """-> tokens [B, S], lengths [B], response start [B] (sequences cut to max_len, padded with 0)."""
    seqs = [(data[i]["prompt_ids"] + data[i]["response_ids"])[:max_len] for i in idx]
    s = max(len(x) for x in seqs)
    tokens = torch.zeros(len(seqs), s, dtype=torch.int64)
    for b, x in enumerate(seqs):
        tokens[b, :len(x)] = torch.tensor(x)
    lengths = torch.tensor([len(x) for x in seqs])
    starts = torch.tensor([min(len(data[i]["prompt_ids"]), max_len) for i in idx])
    return tokens.to(device), lengths.to(device), starts.to(device)
