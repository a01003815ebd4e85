"""Evaluate a trained head with the engine and write the training report (JSON + PNG plots)."""

from __future__ import annotations

import json
from pathlib import Path

from specserve.core.metrics import SpecStats
from specserve.train.devsets import build_dev_sets
from specserve.train.prompts import read_prompts


EVAL_KV_BYTES = 4 << 30  # the evaluation engine's KV cache on a GPU


def acceptance(target, method: str, head_dir, sets: dict[str, list], draft_len: int, max_tokens: int,
               device=None, dtype: str = "auto") -> dict:
    """Greedy acceptance of ``head_dir`` on each named set of chat prompts (a user message each, or whole
    conversations: lists of messages): acceptance length and per-position acceptance a set. One engine serves
    every set (starting one, graphs captured, costs more than a small set's generation), its counters and
    prefix cache reset between sets; each set's line is printed as it ends."""
    from specserve import LLM, SamplingParams
    from specserve.config import resolve_device

    # a fixed cache on the GPU (the scheduler runs fewer prompts at once where it is short), not a share of
    # the card: another head may be training on the same GPU (`gpu.sh train` with METHODS="eagle3 mtp" trains two)
    kv = EVAL_KV_BYTES if resolve_device(device).type == "cuda" else None
    llm = LLM(target, device=device, dtype=dtype, max_num_seqs=128, kv_cache_memory_bytes=kv,
              speculative_config=dict(method=method, draft_model=str(head_dir), max_draft_len=draft_len))
    tok, eng = llm.tokenizer, llm.engine
    results = {}
    for name, prompts in sets.items():
        # each set counted and computed afresh, as `specserve bench` does between runs: the dev sets repeat the
        # held-out prompts, and a prefix cached by one set would change the next one's batches
        eng.spec_stats = SpecStats()
        eng.pool.reset_cache()
        convs = [[{"role": "user", "content": p}] if isinstance(p, str) else p for p in prompts]
        reqs = [{"prompt_token_ids": tok.apply_chat_template(c)} for c in convs]
        outs = llm.generate(reqs, SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=True,
                            raise_on_error=False)
        st = eng.spec_stats
        results[name] = {"prompts": len(prompts), "generated_tokens": sum(len(o.token_ids) for o in outs),
                         "drafted": st.num_drafted, "accepted": st.num_accepted,
                         "verify_steps": st.num_verify_steps, "emitted": st.num_emitted,
                         "acceptance_length": st.acceptance_length, "acceptance_rate": st.acceptance_rate,
                         "per_position_acceptance": st.per_position, "draft_len": draft_len}
        print(f"{name}: {_line(results[name])}", flush=True)  # as it ends: a killed run keeps these
    return results


def _line(e: dict) -> str:
    if e["acceptance_length"] is None:
        return "no speculative step ran (outputs too short to measure acceptance)"
    pos = " ".join(f"{p:.2f}" for p in e["per_position_acceptance"])
    return f"acceptance length {e['acceptance_length']:.2f} (D={e['draft_len']}), per position [{pos}]"


def evaluate(cfg, head_dir: Path, holdout: list[str], trained: list = ()) -> dict:
    """Acceptance on the held-out part of the training prompt files, on each extra eval file, and on the
    development sets (``--dev-set-size``: from records of neither ``trained`` prompts nor training files)."""
    n = cfg.eval_max_prompts or None  # 0: every prompt of each set
    sets = {}
    if holdout:
        sets["holdout"] = holdout[:n]
    files = {f: read_prompts([f]) for f in cfg.eval_prompts}
    for f, ps in files.items():
        sets[Path(f).name] = ps[:n]
    if cfg.dev_set_size:  # held-out prompts and every evaluation file's, less any prompt trained on
        allowed = (set(holdout) | {p for ps in files.values() for p in ps}) - {p for p in trained
                                                                                if isinstance(p, str)}
        dev = build_dev_sets(list(cfg.prompts) + list(cfg.eval_prompts), allowed, cfg.dev_set_size, cfg.seed,
                             (max(1, cfg.doc_tokens // 4), cfg.doc_tokens))
        sets.update({f"dev/{cat}": convs for cat, convs in dev.items()})
    return acceptance(cfg.target, cfg.method, head_dir, sets, cfg.eval_draft_len, cfg.eval_max_tokens,
                      cfg.device) if sets else {}


def dev_summary(evals: dict) -> dict:
    """The development sets' results by category: acceptance length and per-position acceptance."""
    return {name[len("dev/"):]: {"acceptance_length": e["acceptance_length"], "prompts": e["prompts"],
                                 "per_position_acceptance": e["per_position_acceptance"]}
            for name, e in evals.items() if name.startswith("dev/")}


def _smooth(ys: list[float], frac: float = 0.03) -> list[float]:
    """Trailing mean over about ``frac`` of the points (at least 1), NaNs skipped: the trend under the noise of
    single batches."""
    w = max(1, int(len(ys) * frac))
    out = []
    for i in range(len(ys)):
        win = [y for y in ys[max(0, i - w + 1):i + 1] if y == y]
        out.append(sum(win) / len(win) if win else float("nan"))
    return out


def write_report(out: Path, report: dict) -> None:
    (out / "report.json").write_text(json.dumps(report, indent=2))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    hist = report["history"]
    if hist:
        fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
        steps = [h["step"] for h in hist]
        for k in range(len(hist[-1]["losses"])):
            for ax, key in ((a, "losses"), (b, "acc")):
                ys = [h[key][k] if k < len(h[key]) else float("nan") for h in hist]
                line, = ax.plot(steps, ys, alpha=0.25, linewidth=0.8)  # each logged batch
                ax.plot(steps, _smooth(ys), color=line.get_color(), label=f"draft step {k}")
        a.set(xlabel="training step", ylabel="soft cross-entropy", title="loss per unrolled draft step")
        b.set(xlabel="training step", ylabel="top-1 agreement with target", title="training agreement")
        a.legend()
        b.legend()
        fig.tight_layout()
        fig.savefig(out / "loss.png", dpi=110)
        plt.close(fig)
    evals = {k: e for k, e in (report.get("eval") or {}).items() if not k.startswith("dev/")}  # dev: below
    if evals:
        fig, ax = plt.subplots(figsize=(7, 4))
        width = 0.8 / len(evals)
        for i, (name, e) in enumerate(evals.items()):
            pos = e["per_position_acceptance"]
            al = e["acceptance_length"]  # None when the set ran no speculative step (outputs of 1 token)
            ax.bar([j + 1 + (i - (len(evals) - 1) / 2) * width for j in range(len(pos))], pos, width,
                   label=f"{name} (AL {'n/a' if al is None else f'{al:.2f}'})")
        d = max(len(e["per_position_acceptance"]) for e in evals.values())
        ax.set_xticks(range(1, d + 1))
        ax.set(xlabel="draft position", ylabel="acceptance", ylim=(0, 1),
               title="per-position acceptance on held-out prompts (greedy)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "acceptance.png", dpi=110)
        plt.close(fig)
    dev = report.get("dev") or {}
    if dev:
        fig, (a, b) = plt.subplots(1, 2, figsize=(12, 0.4 * len(dev) + 2))
        names = list(dev)
        als = [dev[c]["acceptance_length"] or 0.0 for c in names]  # None: no speculative step ran
        a.barh(names, als)
        for y, al in enumerate(als):
            a.text(al, y, f" {al:.2f}", va="center")
        a.invert_yaxis()
        a.set(xlabel="acceptance length (greedy, bonus token included)", title="development sets by category")
        for c in names:
            pos = dev[c]["per_position_acceptance"]
            b.plot(range(1, len(pos) + 1), pos, marker="o", label=c)
        b.set(xlabel="draft position", ylabel="acceptance", ylim=(0, 1), title="per-position acceptance")
        b.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / "acceptance-by-category.png", dpi=110)
        plt.close(fig)
