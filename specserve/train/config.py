"""``TrainConfig``: the settings of one ``specserve train-draft`` run, validated on construction.

Its own module so that the training modules (``data``, ``generate``, ``trainer``) and the command line import it
without importing each other. ``specserve train-draft`` has one flag per field (``--gen-max-tokens`` for
``gen_max_tokens``) except ``NO_FLAG``; the flags' defaults are the fields' defaults.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any

from specserve.speculative.config import MAX_DRAFT_LEN, METHODS

# fields without a ``train-draft`` flag: tuned constants that tests and scripts may still set
NO_FLAG = ("gen_dtype", "ttt_decay", "save_every", "log_every")
EXPORT_DTYPES = ("bfloat16", "float16", "float32")


@dataclass
class TrainConfig:
    target: str | None
    method: str
    prompts: list[str]
    out: str
    eval_prompts: list[str] = field(default_factory=list)  # extra held-out files (e.g. HumanEval)
    data: list[str] | str | None = None  # reuse regenerated data of earlier runs (their data.pt files, combined)
    holdout: float = 0.05
    max_prompts: int | None = None
    gen_max_tokens: int = 256
    gen_temperature: float = 0.0
    gen_seed: int | None = None  # sampling seed of the regenerated responses (default: seed; the split keeps seed)
    gen_dtype: str = "auto"
    target_dtype: str = "float32"  # target features in training; bfloat16 also runs the head's matmuls in it
    gen_workers: int = 1  # engine processes sharing the device for regeneration
    synthetic_prompts: int = 0  # user messages the target writes itself, added to the training prompts
    synthetic_temperature: float = 1.0
    synthetic_max_tokens: int = 128  # messages the target has not ended by then are dropped
    synthetic_openers: list[str] = field(default_factory=list)  # message i starts with opener i mod n
    init_from: str | None = None  # start from an exported head's weights (same method and layers) instead of random
    regenerate_only: bool = False  # stop once data.pt is written (train heads from it later with --data)
    max_seq_len: int = 1024
    steps: int = 2000
    batch_size: int = 16
    # a batch's padded tokens at most (long documents: fewer sequences a batch); 0: always batch_size sequences
    batch_tokens: int = 0
    lr: float = 5e-4
    warmup: int = 100
    ttt_steps: int = 4
    ttt_decay: float = 0.9
    draft_vocab: int = 0  # 0: share the target's lm_head
    draft_vocab_shared: bool = False  # with draft_vocab: the target's lm_head rows at those tokens, no own lm_head
    aux_layers: tuple[int, ...] | None = None  # EAGLE-3: target layers feeding the head (default (1, L/2-1, L-4))
    seed: int = 0
    device: str | None = None
    save_every: int = 250
    time_limit: float | None = None  # seconds of training (over all resumes) after which the run stops and exports
    stop_after: float | None = None  # seconds of this invocation's training loop after which it checkpoints and exits
    log_every: int = 10
    eval_draft_len: int = 4
    eval_max_prompts: int = 0  # 0: every prompt of each evaluation set
    eval_max_tokens: int = 256
    dev_set_size: int = 0  # conversations a category in the development sets (``train/devsets.py``); 0: none
    category_prompts: int = 0  # training conversations a category made the same way from training records
    doc_tokens: int = 4000  # the longest documents of both, in tokens (the shortest a quarter of it)
    export_dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        if isinstance(self.data, str):
            self.data = [self.data]
        if self.method not in METHODS:
            raise ValueError(f"--method must be eagle3 or mtp, got {self.method!r}")
        if not self.prompts and not self.data and not self.synthetic_prompts:
            raise ValueError("give --prompts FILE [FILE ...], --synthetic-prompts N, or --data from an earlier run")
        if self.synthetic_prompts < 0 or self.synthetic_temperature <= 0:
            raise ValueError("--synthetic-prompts must be >= 0 and --synthetic-temperature > 0")
        if self.synthetic_openers and not self.synthetic_prompts:
            raise ValueError("--synthetic-openers needs --synthetic-prompts N")
        if any(not o.strip() or o != o.strip() for o in self.synthetic_openers):
            raise ValueError("--synthetic-openers: an opener is empty or starts or ends with whitespace")
        if self.synthetic_prompts and self.data:
            raise ValueError("--synthetic-prompts makes new data; it cannot be combined with --data (regenerate "
                             "with --regenerate-only, then train on every data.pt)")
        if self.aux_layers and self.method != "eagle3":
            raise ValueError("--aux-layers applies to --method eagle3 only")
        if self.init_from is not None and not Path(self.init_from).is_dir():
            raise ValueError(f"--init-from {self.init_from}: not a head folder")
        if self.regenerate_only and self.data:
            raise ValueError("--regenerate-only writes new data; it cannot be combined with --data")
        if not 0.0 <= self.holdout < 1.0:
            raise ValueError(f"--holdout must be in [0, 1), got {self.holdout}")
        if self.target_dtype not in ("float32", "bfloat16"):
            raise ValueError(f"--target-dtype must be float32 or bfloat16, got {self.target_dtype!r}")
        for name in ("time_limit", "stop_after"):
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0")
        for name in ("steps", "batch_size", "ttt_steps", "gen_max_tokens", "max_seq_len", "gen_workers",
                     "synthetic_max_tokens"):
            if name == "steps" and self.init_from:
                if self.steps < 0:
                    raise ValueError("--steps must be >= 0 (0 with --init-from: export that head as it is)")
            elif getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        if not 1 <= self.eval_draft_len <= MAX_DRAFT_LEN:  # checked now, not after hours of training
            raise ValueError(f"--eval-draft-len must be in [1, {MAX_DRAFT_LEN}], got {self.eval_draft_len}")
        if min(self.dev_set_size, self.category_prompts, self.batch_tokens) < 0 or self.doc_tokens < 4:
            raise ValueError("--dev-set-size, --category-prompts and --batch-tokens must be >= 0, --doc-tokens >= 4")
        if self.category_prompts and self.doc_tokens + self.gen_max_tokens > self.max_seq_len:
            raise ValueError(f"--category-prompts trains on documents of up to --doc-tokens {self.doc_tokens} tokens "
                             f"and responses of up to --gen-max-tokens {self.gen_max_tokens}: give --max-seq-len at "
                             f"least {self.doc_tokens + self.gen_max_tokens} (now {self.max_seq_len})")
        if self.eval_max_tokens < 1:
            raise ValueError("--eval-max-tokens must be >= 1")
        for name in ("eval_max_prompts", "max_prompts", "warmup", "draft_vocab", "gen_temperature"):
            if (getattr(self, name) or 0) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0")
        if not self.lr > 0:
            raise ValueError(f"--lr must be > 0, got {self.lr}")
        if self.export_dtype not in EXPORT_DTYPES:
            raise ValueError(f"--export-dtype must be one of {EXPORT_DTYPES}, got {self.export_dtype!r}")
        if self.draft_vocab_shared and not (self.method == "eagle3" and self.draft_vocab > 0):
            raise ValueError("--draft-vocab-shared needs --method eagle3 and --draft-vocab N")


def field_defaults() -> dict[str, Any]:
    """The default of every field that has one (fresh lists), by name: the ``train-draft`` flags' defaults."""
    out = {}
    for f in fields(TrainConfig):
        if f.default_factory is not MISSING:
            out[f.name] = f.default_factory()
        elif f.default is not MISSING:
            out[f.name] = f.default
    return out
