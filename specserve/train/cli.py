"""``specserve train-draft``: its flags (one per ``TrainConfig`` field) and the command."""

from __future__ import annotations

import argparse
import dataclasses
import sys


def add_train_parser(sub, formatter) -> None:
    """``train-draft``: one flag per ``TrainConfig`` field (but ``train.config.NO_FLAG``), defaults the fields'."""
    from types import SimpleNamespace

    from specserve.train.config import EXPORT_DTYPES, NO_FLAG, TrainConfig, field_defaults

    d = SimpleNamespace(**field_defaults())
    tr = sub.add_parser("train-draft", help="train an EAGLE-3 or MTP-Eagle draft head for a target model",
                        formatter_class=formatter)
    tr.add_argument("--target", default=None, help="target model (HF folder or .gguf; default: the embedded model)")
    tr.add_argument("--method", required=True, choices=["eagle3", "mtp"])
    tr.add_argument("--prompts", nargs="+", default=[], help="prompt files (JSONL/JSON, .gz allowed)")
    tr.add_argument("--out", required=True, help="output folder (checkpoint, head/, report.json, plots)")
    tr.add_argument("--eval-prompts", nargs="*", default=d.eval_prompts,
                    help="extra held-out prompt files for the report")
    tr.add_argument("--data", nargs="+", default=d.data,
                    help="reuse regenerated data (data.pt) of earlier runs; several files are combined")
    tr.add_argument("--holdout", type=float, default=d.holdout, help="fraction of prompts held out of training")
    tr.add_argument("--max-prompts", type=int, default=d.max_prompts)
    tr.add_argument("--gen-max-tokens", type=int, default=d.gen_max_tokens,
                    help="max tokens of each regenerated response")
    tr.add_argument("--gen-temperature", type=float, default=d.gen_temperature,
                    help="temperature of the regenerated responses")
    tr.add_argument("--gen-seed", type=int, default=d.gen_seed,
                    help="sampling seed of the regenerated responses (and of --synthetic-prompts): request i uses "
                         "seed N + i, so give runs seeds further apart than the number of prompts (default: --seed, "
                         "which also splits the prompts)")
    tr.add_argument("--gen-workers", type=int, default=d.gen_workers,
                    help="engine processes regenerating in parallel on the device (a small target is host-bound)")
    tr.add_argument("--synthetic-prompts", type=int, default=d.synthetic_prompts, metavar="N",
                    help="also train on N user messages the target writes itself (sampled from its chat template "
                         "up to a user turn): general prompts when the prompt files cover few domains")
    tr.add_argument("--synthetic-temperature", type=float, default=d.synthetic_temperature)
    tr.add_argument("--synthetic-openers", nargs="+", default=d.synthetic_openers, metavar="WORDS",
                    help="start synthesized message i with opener i mod n (e.g. Classify Rewrite \"Tell me\"), for "
                         "requests of those kinds rather than the kind the target writes most often")
    tr.add_argument("--synthetic-max-tokens", type=int, default=d.synthetic_max_tokens,
                    help="longest synthesized message; ones the target has not ended by then are dropped")
    tr.add_argument("--init-from", default=d.init_from, metavar="HEAD",
                    help="start from an exported head's weights (same method and layers), e.g. to fine-tune a "
                         "shipped head on more data")
    tr.add_argument("--regenerate-only", action="store_true",
                    help="write the regenerated data (OUT/data.pt) and stop; train from it later with --data")
    tr.add_argument("--target-dtype", default=d.target_dtype, choices=["float32", "bfloat16"],
                    help="dtype of the target's features in training (bfloat16 also runs the head's matmuls in it)")
    tr.add_argument("--max-seq-len", type=int, default=d.max_seq_len)
    tr.add_argument("--steps", type=int, default=d.steps)
    tr.add_argument("--batch-size", type=int, default=d.batch_size, help="sequences per training step")
    tr.add_argument("--batch-tokens", type=int, default=d.batch_tokens,
                    help="at most this many padded tokens a step: a batch of long sequences takes fewer of them "
                         "(at least one; default 0: always --batch-size)")
    tr.add_argument("--lr", type=float, default=d.lr)
    tr.add_argument("--warmup", type=int, default=d.warmup)
    tr.add_argument("--ttt-steps", type=int, default=d.ttt_steps,
                    help="draft steps unrolled in training-time test")
    tr.add_argument("--draft-vocab", type=int, default=d.draft_vocab,
                    help="EAGLE-3: own lm_head over the N most frequent tokens (0: share the target's lm_head)")
    tr.add_argument("--draft-vocab-shared", action="store_true",
                    help="with --draft-vocab N: no own lm_head, the target's lm_head rows at those N tokens (a "
                         "small head file and cheaper draft steps; with --init-from HEAD --steps 0, restricts a "
                         "head trained on the whole vocabulary)")
    tr.add_argument("--aux-layers", type=int, nargs=3, default=d.aux_layers, metavar="LAYER",
                    help="EAGLE-3: the three target layers whose outputs feed the head (default: 1, L/2-1, L-4)")
    tr.add_argument("--seed", type=int, default=d.seed)
    tr.add_argument("--device", default=d.device)
    tr.add_argument("--eval-draft-len", type=int, default=d.eval_draft_len)
    tr.add_argument("--eval-max-prompts", type=int, default=d.eval_max_prompts,
                    help="evaluate on at most this many prompts of each set (default 0: all of them)")
    tr.add_argument("--eval-max-tokens", type=int, default=d.eval_max_tokens)
    tr.add_argument("--dev-set-size", type=int, default=d.dev_set_size, metavar="N",
                    help="also evaluate on development sets of N conversations a category (chat, code, long-document "
                         "summarization and questions, multi-turn, rewriting, extraction, translation, math), built "
                         "from the held-out and evaluation prompts' records (default 0: none)")
    tr.add_argument("--category-prompts", type=int, default=d.category_prompts, metavar="N",
                    help="add N training conversations a category made the same way from the training prompts' "
                         "records (documents to summarize and question, multi-turn, rewriting, extraction, "
                         "translation, math), answered by the target (default 0: none)")
    tr.add_argument("--doc-tokens", type=int, default=d.doc_tokens,
                    help="longest document of the development sets and --category-prompts, in tokens (the shortest "
                         "is a quarter of it); give --max-seq-len room for it and the response")
    tr.add_argument("--time-limit", type=float, default=d.time_limit,
                    help="stop training after this many seconds (counted over resumes; the LR decays over it)")
    tr.add_argument("--stop-after", type=float, default=d.stop_after,
                    help="checkpoint and exit after this many seconds of this invocation; rerun to resume")
    tr.add_argument("--export-dtype", default=d.export_dtype, choices=list(EXPORT_DTYPES))
    tr.add_argument("-v", "--verbose", action="store_true")
    missing = sorted({f.name for f in dataclasses.fields(TrainConfig)} - {x.dest for x in tr._actions} - set(NO_FLAG))
    if missing:  # a new field needs a flag (or a place in NO_FLAG): fail on every use, not on some run's
        raise AssertionError(f"TrainConfig fields without a train-draft flag: {missing}")


def train_config(a: argparse.Namespace):
    """The parsed ``train-draft`` flags -> ``TrainConfig`` (validated): every field but ``NO_FLAG`` by its flag."""
    from specserve.train.config import NO_FLAG, TrainConfig

    return TrainConfig(**{f.name: getattr(a, f.name) for f in dataclasses.fields(TrainConfig) if f.name not in NO_FLAG})


def cmd_train(a: argparse.Namespace) -> int:
    from specserve.train.trainer import train

    try:
        cfg = train_config(a)
        report = train(cfg)
    except (ValueError, OSError) as e:  # bad options, unreadable or missing files
        print(f"specserve: error: {e}", file=sys.stderr)
        return 2
    if report.get("paused"):
        print(f"paused at step {report['step']} after {report['train_seconds']:.0f} s of training; "
              f"run the same command again to resume from {report['checkpoint']}")
        return 0
    if cfg.regenerate_only:
        print(f"regenerated {report['regenerated']} sequences into {report['data']}")
        return 0
    print(f"head written to {a.out}/head; report in {a.out}/report.json")
    return 0
