"""``specserve train-draft``: train an EAGLE-3 or MTP-Eagle head for a target model.

1. Regenerate responses to the prompts with the target itself (specserve's engine, chat template), so the
   head learns the target's own distribution; held-out prompts are split off first and never trained on.
2. For each batch of sequences, run the target (float32, or bfloat16 with ``target_dtype`` and the head's
   matmuls under autocast; dense causal attention) for the features the head
   needs (three aux layers for EAGLE-3, the final hidden state for MTP) and its next-token distribution.
3. Training-time test: unroll ``ttt_steps`` draft steps; step k feeds the head's own previous output as
   hidden state and is trained, with soft cross-entropy, towards the target's distribution k + 2 tokens ahead.
4. Checkpoint (resumable, seeded), export in the layout the worker loads, evaluate acceptance with the
   engine on held-out prompts, and write a JSON report and PNG plots (``report.py``).
"""

from __future__ import annotations

import json
import logging
import math
import random
import time
from dataclasses import asdict
from pathlib import Path

import torch

from specserve.config import resolve_device
from specserve.loaders import load_model
from specserve.speculative.checkpoint import bind_head, save_eagle3_head, save_mtp_head
from specserve.speculative.config import default_eagle3_layers
from specserve.speculative.heads import DraftHead, Eagle3Head, MTPHead
from specserve.train.attention import DenseCausal, TrainingTimeTest
from specserve.train.config import TrainConfig  # also importable from here, as before the move
from specserve.train.data import load_data, make_batch, sample_batch, split_prompts
from specserve.train.devsets import build_dev_sets
from specserve.train.generate import regenerate, synthesize_prompts  # noqa: F401 (regenerate: public here)
from specserve.train.prompts import read_prompts

log = logging.getLogger("specserve")


# ---------------------------------------------------------------------------------------------
# model


def eagle3_layers(cfg: TrainConfig, n: int) -> tuple[int, ...]:
    """The EAGLE-3 head's target layers for a target of ``n`` layers: ``--aux-layers`` (checked, sorted) or
    the default (which repeats layers on targets of fewer than 7 layers; the head accepts that)."""
    if not cfg.aux_layers:
        return default_eagle3_layers(n)
    layers = tuple(cfg.aux_layers)
    if len(layers) != 3 or len(set(layers)) != 3 or not all(0 <= a < n for a in layers):
        raise ValueError(f"--aux-layers needs three different layer ids in [0, {n}), got {layers}")
    return tuple(sorted(layers))


def build_head(cfg: TrainConfig, target, data: list[dict]) -> DraftHead:
    tcfg = target.config
    torch.manual_seed(cfg.seed)
    if cfg.method == "eagle3":
        dv = cfg.draft_vocab if 0 < cfg.draft_vocab < tcfg.vocab_size else None
        head: DraftHead = Eagle3Head(tcfg, eagle3_layers(cfg, tcfg.num_hidden_layers), dv,
                                     shared_lm_head=cfg.draft_vocab_shared)
        if dv is not None:  # the dv most frequent tokens of the regenerated responses
            counts = torch.zeros(tcfg.vocab_size, dtype=torch.int64)
            for d in data:
                counts += torch.bincount(torch.tensor(d["response_ids"]), minlength=tcfg.vocab_size)
            # most frequent first, ties by token id: the same choice on every machine and torch version
            ids = torch.sort(counts, descending=True, stable=True).indices[:dv].sort().values
            head.d2t.copy_(ids - torch.arange(dv))
    else:
        head = MTPHead(tcfg, 1, own_head=False, eagle=True)
    head = head.to(next(target.parameters()).device)
    bind_head(head, target)
    return head.train().requires_grad_(True)


def check_init_from(cfg: TrainConfig, tcfg) -> None:
    """What ``init_from_head`` would refuse, read from the head's config.json alone (before any regeneration)."""
    raw = json.loads((Path(cfg.init_from) / "config.json").read_text()) \
        if (Path(cfg.init_from) / "config.json").is_file() else {}
    is_eagle3 = "eagle_config" in raw or any("Eagle3" in a for a in raw.get("architectures", []))
    if (cfg.method == "eagle3") != is_eagle3:
        raise ValueError(f"--init-from {cfg.init_from} is not an {cfg.method} head")
    if cfg.method != "eagle3":
        return
    ids = raw.get("eagle_config", {}).get("eagle_aux_hidden_state_layer_ids")
    if ids is not None and tuple(i - 1 for i in ids) != eagle3_layers(cfg, tcfg.num_hidden_layers):
        raise ValueError(f"--init-from {cfg.init_from} reads target layers {[i - 1 for i in ids]}, this run "
                         f"{list(eagle3_layers(cfg, tcfg.num_hidden_layers))}: give the same --aux-layers")
    dv = raw.get("draft_vocab_size", tcfg.vocab_size)
    want = cfg.draft_vocab if 0 < cfg.draft_vocab < tcfg.vocab_size else tcfg.vocab_size
    own = (Path(cfg.init_from) / "model.safetensors").is_file() and _has_lm_head(Path(cfg.init_from))
    if dv == tcfg.vocab_size and not own and cfg.draft_vocab_shared:
        return  # a head on the target's whole lm_head keeps its weights on a subset of its rows
    if dv != want:
        raise ValueError(f"--init-from {cfg.init_from} drafts over {dv} tokens, this run over {want}: "
                         f"give --draft-vocab {dv if dv < tcfg.vocab_size else 0}")
    if dv < tcfg.vocab_size and own == cfg.draft_vocab_shared:
        raise ValueError(f"--init-from {cfg.init_from} {'has' if own else 'has no'} lm_head of its own: "
                         f"{'leave out' if own else 'give'} --draft-vocab-shared")


def _has_lm_head(folder: Path) -> bool:
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        return "lm_head.weight" in f.keys()


def init_from_head(head: DraftHead, cfg: TrainConfig, target, device) -> None:
    """Copy an exported head's weights into the freshly built ``head`` (fine-tuning a shipped head)."""
    from specserve.speculative.checkpoint import load_draft_head
    from specserve.speculative.config import SpeculativeConfig

    spec = SpeculativeConfig(method=cfg.method, draft_model=cfg.init_from, mtp_eagle=True if cfg.method == "mtp" else None)
    src = load_draft_head(spec, target, device, torch.float32)
    if tuple(src.aux_layers) != tuple(head.aux_layers):
        raise ValueError(f"--init-from {cfg.init_from} reads target layers {list(src.aux_layers)}, this run "
                         f"{list(head.aux_layers)}: give the same --aux-layers")
    state = src.state_dict()
    if "d2t" in state and len(state["d2t"]) == 0 and head.lm_head is None:  # on a subset of the target's rows
        state["d2t"] = head.d2t
    try:
        head.load_state_dict(state)
    except RuntimeError as e:
        raise ValueError(f"--init-from {cfg.init_from} does not fit this run's head (its vocabulary, embedding or "
                         f"lm_head differ; see --draft-vocab): {e}") from None
    head.requires_grad_(True)
    log.info("starting from the weights of %s", cfg.init_from)


@torch.no_grad()
def target_features(target, head: DraftHead, tokens: torch.Tensor):
    """tokens [B, S] -> (final hidden [B, S, H], aux hidden states the head reads)."""
    b, s = tokens.shape
    pos = torch.arange(s, device=tokens.device).expand(b, s)
    n = target.config.num_hidden_layers
    return target(tokens, pos, DenseCausal(), [(None, None)] * n, aux_layers=head.aux_layers)


def response_rows(lengths: torch.Tensor, starts: torch.Tensor, s: int) -> torch.Tensor:
    """[B, S] bool: rows j whose next-token distribution predicts a response token (start <= j + 1 < length)."""
    j = torch.arange(s, device=lengths.device)[None, :]
    return (j + 1 >= starts[:, None]) & (j + 1 < lengths[:, None])


@torch.no_grad()
def target_probs(target, hidden: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """hidden [B, S, H], rows [B, S] bool -> the target's next-token distribution at those rows [N, V]."""
    return target.compute_logits(hidden[rows]).float().softmax(dim=-1)


def ttt_loss(cfg: TrainConfig, head: DraftHead, tokens, lengths, starts, hidden, aux):
    """Unrolled training-time-test loss. Returns (loss, per-step losses, per-step top-1 agreement); the loss
    is None when the batch has no response token to train on."""
    b, s = tokens.shape
    dev = tokens.device
    pos = torch.arange(s, device=dev).expand(b, s)
    rows = response_rows(lengths, starts, s)  # [B, S]
    if not bool(rows.any()):  # no response token in this batch (every prompt filled max_seq_len)
        return None, [], []
    probs = target_probs(head.target, hidden, rows)  # [N, V], rows in (b, j) order
    row_pos = pos[rows]  # [N]: j of each row
    vocab_ids = head.vocab_ids()
    if vocab_ids is not None:
        probs = probs[:, vocab_ids]
        probs = probs / probs.sum(-1, keepdim=True).clamp_min(1e-9)
    h = head.first_hidden(hidden, aux)
    tta = TrainingTimeTest()
    total = torch.zeros((), device=dev)
    losses, accs = [], []
    norm = sum(cfg.ttt_decay ** k for k in range(cfg.ttt_steps))
    for k in range(cfg.ttt_steps):
        shift = k + 1
        ids = torch.zeros_like(tokens)
        ids[:, :s - shift] = tokens[:, shift:]  # the token at position i + k + 1
        out = head.run_module(k, ids, pos + k, h, tta, (None, None))
        # anchor i predicts the token at i + k + 2, whose target distribution sits at row j = i + k + 1
        if s - k - 1 <= 0:
            break
        anchors = rows[:, k + 1:]  # [B, S-k-1]: anchor i <-> row i + k + 1
        p = probs[row_pos >= k + 1]  # [N_k, V'], same (b, i) order as out[:, :S-k-1][anchors]
        if p.shape[0] == 0:
            break
        # vocabulary-sized tensors only for response positions (most of a padded batch is not)
        logq = head.logits(k, out[:, :s - k - 1][anchors]).log_softmax(dim=-1)  # [N_k, V']
        denom = p.shape[0]
        lk = -(p * logq).sum() / denom
        total = total + (cfg.ttt_decay ** k / norm) * lk
        losses.append(lk.item())
        accs.append((logq.argmax(-1) == p.argmax(-1)).sum().item() / denom)
        h = out
    return total, losses, accs


# ---------------------------------------------------------------------------------------------
# loop


def _lr(cfg: TrainConfig, step: int, elapsed: float = 0.0) -> float:
    """Linear warm-up, then cosine decay to 10% over the planned steps, or over ``time_limit`` seconds
    when that comes first (so a run cut short by its time limit still ends at the low learning rate)."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    t = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    if cfg.time_limit:
        t = max(t, elapsed / cfg.time_limit)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))


# options that shape the regenerated data (prompts_split.json, data.pt) and the head's layout (checkpoint.pt):
# a run resumed in the same --out must keep them (steps, learning rate and time limits may change)
DATA_OPTIONS = ("target", "prompts", "max_prompts", "holdout", "seed", "gen_max_tokens", "gen_temperature",
                "gen_seed", "gen_dtype", "synthetic_prompts", "synthetic_temperature", "synthetic_max_tokens",
                "synthetic_openers", "category_prompts", "doc_tokens")
HEAD_OPTIONS = ("target", "method", "data", "draft_vocab", "draft_vocab_shared", "aux_layers")


def check_resume(cfg: TrainConfig, out: Path) -> None:
    """Refuse to resume the run in ``out`` with options that would silently not apply: its cached data was made
    with other data options, or its checkpoint holds a head of another layout."""
    prev_path = out / "train_config.json"
    if not prev_path.is_file():
        return
    prev = json.loads(prev_path.read_text())
    now = json.loads(json.dumps(asdict(cfg)))  # tuples as lists, as the file holds them
    keys: list[str] = []
    if not cfg.data and ((out / "prompts_split.json").is_file() or (out / "data.pt").is_file()):
        keys += DATA_OPTIONS
    if (out / "checkpoint.pt").is_file():
        keys += HEAD_OPTIONS
    diff = [k for k in dict.fromkeys(keys) if k in prev and prev[k] != now.get(k)]
    if diff:
        was = ", ".join(f"--{k.replace('_', '-')} {prev[k]!r} (now {now.get(k)!r})" for k in diff)
        raise ValueError(f"{out} holds a run made with {was}: its cached data or checkpoint would not follow; "
                         "resume with the same options, or use another --out")


def _save_checkpoint(path: Path, head: DraftHead, opt, next_step: int, history: list, seconds: float) -> None:
    torch.save({"head": head.state_dict(), "opt": opt.state_dict(), "step": next_step, "history": history,
                "train_seconds": seconds, "aux_layers": list(head.aux_layers)}, path)


def train(cfg: TrainConfig) -> dict:
    from tqdm import tqdm

    if (cfg.aux_layers or cfg.init_from) and not cfg.regenerate_only:  # checked before a long regeneration
        from specserve.loaders import load_config

        tcfg = load_config(cfg.target)
        eagle3_layers(cfg, tcfg.num_hidden_layers)
        if cfg.init_from:
            check_init_from(cfg, tcfg)
    if cfg.eval_prompts:  # a bad file fails now, not after training
        read_prompts(cfg.eval_prompts)
    out = Path(cfg.out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file, not a folder")
    out.mkdir(parents=True, exist_ok=True)
    check_resume(cfg, out)
    (out / "train_config.json").write_text(json.dumps(asdict(cfg), indent=2))
    device = resolve_device(cfg.device)
    torch.backends.cuda.matmul.allow_tf32 = True

    # prompts and data (cached, so a resumed run trains on the same data)
    split_path = out / "prompts_split.json"
    if split_path.is_file():
        split = json.loads(split_path.read_text())
        asked, openers = split.get("synthetic_asked", 0), split.get("synthetic_openers", [])
        if not cfg.data and (cfg.synthetic_prompts, cfg.synthetic_openers) != (asked, openers):
            raise ValueError(f"{split_path} was made with --synthetic-prompts {asked} and openers {openers}, not "
                             f"{cfg.synthetic_prompts} and {cfg.synthetic_openers}: resume with the same options, "
                             "or use another --out")
    else:
        t0 = time.perf_counter()
        train_p, hold_p = split_prompts(cfg) if cfg.prompts else ([], [])
        split = {"train": train_p, "holdout": hold_p}
        if cfg.category_prompts and cfg.prompts and not cfg.data:  # from training records only
            made = build_dev_sets(cfg.prompts, set(train_p), cfg.category_prompts, cfg.seed + 1,
                                  (max(1, cfg.doc_tokens // 4), cfg.doc_tokens), development=False)
            split.update(train=train_p + [c for convs in made.values() for c in convs],
                         category_prompts={cat: len(convs) for cat, convs in made.items()})
        if cfg.synthetic_prompts and not cfg.data:
            exclude = set(hold_p) | set(read_prompts(cfg.eval_prompts) if cfg.eval_prompts else [])
            synth = synthesize_prompts(cfg, exclude)
            split.update(train=split["train"] + synth, synthetic=len(synth), synthetic_asked=cfg.synthetic_prompts,
                         synthetic_openers=cfg.synthetic_openers,
                         synth_seconds=time.perf_counter() - t0)
        split_path.write_text(json.dumps(split))
    data_path = out / "data.pt"
    if cfg.data:
        data = load_data(cfg.data)
    elif data_path.is_file():
        data = torch.load(data_path)
        log.info("loaded %d regenerated sequences from %s", len(data["train"]), data_path)
    else:
        t0 = time.perf_counter()
        data = {"train": regenerate(cfg, split["train"]), "holdout_prompts": split["holdout"],
                "train_prompts": split["train"], "category_prompts": split.get("category_prompts", {})}
        data["gen_seconds"] = time.perf_counter() - t0 + split.get("synth_seconds", 0.0)
        torch.save(data, data_path)
    seqs = data["train"]
    if cfg.regenerate_only:
        log.info("regenerated %d sequences into %s; train from them with --data", len(seqs), data_path)
        return {"regenerated": len(seqs), "data": str(data_path), "gen_seconds": data.get("gen_seconds")}
    if not seqs:
        raise ValueError("no training sequences: every prompt failed or produced nothing")
    cut = sum(len(d["prompt_ids"]) >= cfg.max_seq_len for d in seqs)
    if cut:
        log.warning("%d of %d sequences have prompts of --max-seq-len %d tokens or more: none of their response is "
                    "trained on", cut, len(seqs), cfg.max_seq_len)
    holdout = data.get("holdout_prompts", split["holdout"])

    low = cfg.target_dtype == "bfloat16"  # head weights and optimizer state stay float32 either way
    target = load_model(cfg.target, torch.bfloat16 if low else torch.float32, device).model
    head = build_head(cfg, target, seqs)
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    history: list[dict] = []
    start, prior = 0, 0.0
    ckpt = out / "checkpoint.pt"
    if ckpt.is_file():
        state = torch.load(ckpt, map_location=device)
        if state.get("aux_layers", list(head.aux_layers)) != list(head.aux_layers):
            raise ValueError(f"{ckpt} was trained on target layers {state['aux_layers']}, not "
                             f"{list(head.aux_layers)}: resume with the same --aux-layers, or use another --out")
        head.load_state_dict(state["head"])
        opt.load_state_dict(state["opt"])
        start, history, prior = state["step"], state["history"], state.get("train_seconds", 0.0)
        log.info("resuming from step %d (%.0f s trained)", start, prior)
    elif cfg.init_from:
        init_from_head(head, cfg, target, device)

    t_call = time.perf_counter()

    def elapsed() -> float:  # training seconds over every invocation: the time limit and the LR decay use it
        return prior + time.perf_counter() - t_call

    bar = tqdm(range(start, cfg.steps), initial=start, total=cfg.steps, desc=f"train {cfg.method}", unit="step")
    stopped_early = paused = None
    for step in bar:
        if cfg.time_limit is not None and elapsed() > cfg.time_limit:
            stopped_early = step
            log.warning("time limit of %.0f s reached: stopping at step %d of %d", cfg.time_limit, step, cfg.steps)
            _save_checkpoint(ckpt, head, opt, step, history, elapsed())
            break
        if cfg.stop_after is not None and time.perf_counter() - t_call > cfg.stop_after:
            paused = step
            _save_checkpoint(ckpt, head, opt, step, history, elapsed())
            break
        rng = random.Random(cfg.seed * 1_000_003 + step)  # batch of step n is the same after a resume
        idx = sample_batch(rng, seqs, cfg.batch_size, cfg.batch_tokens, cfg.max_seq_len)
        tokens, lengths, starts = make_batch(seqs, idx, cfg.max_seq_len, device)
        hidden, aux = target_features(target, head, tokens)
        for g in opt.param_groups:
            g["lr"] = lr = _lr(cfg, step, elapsed())
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=low):
            loss, losses, accs = ttt_loss(cfg, head, tokens, lengths, starts, hidden, aux)
        if loss is None:
            log.warning("step %d: no response tokens within --max-seq-len in this batch; skipped", step)
            continue
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if step % cfg.log_every == 0 or step == cfg.steps - 1:
            history.append({"step": step, "loss": loss.item(), "losses": losses, "acc": accs, "lr": lr})
            bar.set_postfix(loss=f"{loss.item():.3f}", acc0=f"{accs[0]:.2f}")
        if (step + 1) % cfg.save_every == 0 or step == cfg.steps - 1:
            _save_checkpoint(ckpt, head, opt, step + 1, history, elapsed())
    bar.close()
    train_seconds = elapsed()
    if paused is not None:
        log.warning("--stop-after %.0f s: checkpoint at step %d of %d in %s; run the same command again to resume",
                    cfg.stop_after, paused, cfg.steps, ckpt)
        return {"paused": True, "step": paused, "train_seconds": train_seconds, "checkpoint": str(ckpt)}

    head_dir = out / "head"
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[cfg.export_dtype]
    steps_done = stopped_early if stopped_early is not None else cfg.steps
    meta = {"specserve_training": {"target": str(cfg.target or "default"), "steps": steps_done,
                                   "ttt_steps": cfg.ttt_steps, "sequences": len(seqs), "seed": cfg.seed}}
    if cfg.init_from:  # what the starting head had been trained on
        src = json.loads((Path(cfg.init_from) / "config.json").read_text()).get("specserve_training")
        meta["specserve_training"].update(init_from=str(cfg.init_from), init_from_training=src)
    (save_eagle3_head if cfg.method == "eagle3" else save_mtp_head)(head.eval(), head_dir, meta, dtype=dtype)
    del target, head, opt, params  # the evaluation's engine below sizes its cache from the memory left
    if torch.cuda.is_available():
        torch.cuda.empty_cache()

    from specserve.train.report import dev_summary, evaluate, write_report

    evals = evaluate(cfg, head_dir, holdout, trained=data.get("train_prompts", split.get("train", [])))
    report = {"config": asdict(cfg), "train_sequences": len(seqs),
              "train_tokens": sum(len(d["response_ids"]) for d in seqs), "gen_seconds": data.get("gen_seconds"),
              "train_seconds": train_seconds, "steps_done": steps_done, "head_bytes": (head_dir / "model.safetensors").stat().st_size,
              "final": history[-1] if history else None, "history": history, "eval": evals,
              "dev": dev_summary(evals)}
    write_report(out, report)
    return report
