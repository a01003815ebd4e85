"""``specserve bench`` outputs: a printed table, ``bench.json``, ``bench.md`` and ``bench.png``."""

from __future__ import annotations

import json
from pathlib import Path


def _f(x, fmt=".1f") -> str:
    return "-" if x is None else format(x, fmt)


def _spec(row: dict) -> str:
    """A row's speculation as the table prints it: off, on (the chain), or its kind ("tree 4x5x24", ...)."""
    kind = row.get("speculative")
    return kind if isinstance(kind, str) else ("on" if kind else "off")


def _on(flag) -> str:
    return {True: "on", False: "off"}.get(flag, "-")


def table(result: dict) -> str:
    """The rows as a markdown table, then the ratios and step timings."""
    meta = result["meta"]
    versions = meta.get("versions") or {"torch": meta.get("torch")}
    lines = [f"model {meta['model']} · {meta['device']} · {meta['date']}",
             " · ".join(f"{k} {v}" for k, v in versions.items() if v is not None)
             + (f" · commit {meta['commit']}" if meta.get("commit") else "")]
    if meta.get("settings"):
        lines.append("settings: " + " · ".join(f"{k}={v}" for k, v in meta["settings"].items()))
    if meta.get("command"):
        lines.append(f"`{meta['command']}`")
    lines += ["",
             "| engine | spec | overlap | prefix cache (hits) | batch | new tok | tok/s | step ms | AL | per-position | "
             "TTFT p50/p90/p99 ms | TPOT p50/p90/p99 ms | weight GB/s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        spec, overlap, cache = _spec(r), _on(r.get("overlap")), _on(r.get("prefix_caching"))
        if r.get("prefix_hit_rate") is not None:
            cache += f" ({r['prefix_hit_rate']:.0%})"
        al = _f(r.get("acceptance_length"), ".2f")
        pp = " ".join(f"{p:.2f}" for p in r.get("per_position_acceptance") or []) or "-"
        ttft = "/".join(_f(r["ttft_ms"][k]) for k in ("p50", "p90", "p99")) if "ttft_ms" in r else "-"
        tpot = "/".join(_f(r["tpot_ms"][k], ".2f") for k in ("p50", "p90", "p99")) if "tpot_ms" in r else "-"
        bw = _f(r.get("achieved_weight_gbps"), ".0f")
        lines.append(f"| {r['engine']} | {spec} | {overlap} | {cache} | {r['batch']} | {r['new_tokens']} | "
                     f"{r['tokens_per_s']:.1f} | {_f(r.get('step_ms'), '.3f')} | {al} | {pp} | {ttft} | {tpot} | {bw} |")
    for k, v in meta.items():
        if k.endswith("_error"):  # a baseline that could not run
            msg = (str(v).splitlines() or [""])[0].replace("|", "/")[:200]
            lines.append(f"| {k[:-len('_error')]} | failed: {msg} | | | | | | | | | | | |")
    late = [r for r in result["rows"] if r.get("timed_captures")]
    if late:  # the warm-up did not meet every graph these runs needed: their times include the captures
        lines += ["", "CUDA graphs captured during timed runs (their times include the captures): "
                  + "; ".join(f"{r['engine']} {_spec(r)} batch {r['batch']}: {r['timed_captures']}" for r in late)]
    mixed = [r for r in result["rows"] if sum(1 for n in r.get("steps_by_draft_len") or [] if n) > 1]
    if mixed:  # engines whose steps proposed different numbers of drafts (adaptive D; a tree or its chain)
        lines += ["", "| steps by drafts proposed a row: engine | spec | overlap | batch | drafts: steps |",
                  "|---|---|---|---|---|"]
        lines += [f"| {r['engine']} | {_spec(r)} | {_on(r.get('overlap'))} | {r['batch']} | "
                  + " ".join(f"{d}: {n}" for d, n in enumerate(r["steps_by_draft_len"]) if n) + " |" for r in mixed]
    if result.get("ratios"):
        lines += ["", "| ratio (tokens/s) | value |", "|---|---|"]
        lines += [f"| {k} | {v:.2f}x |" for k, v in result["ratios"].items()]
    for s in result.get("steps", []):
        lines += ["", f"Step times at batch {s['batch']}, context {s['context']}, D = {s['draft_len']} "
                      f"(CUDA-graph replays, median; copy bandwidth {s['copy_bandwidth_gbps']:.0f} GB/s):", "",
                  "| piece | ms | roofline ms | ratio |", "|---|---|---|---|",
                  f"| decode step | {s['decode_ms']:.3f} | {s['decode_roofline_ms']:.3f} | "
                  f"{s['decode_fraction_of_roofline']:.0%} of roofline"
                  + (f" ({s['decode_fraction_of_all_weights_roofline']:.0%} counting every weight)"
                     if s.get("decode_fraction_of_all_weights_roofline", s['decode_fraction_of_roofline'])
                     != s['decode_fraction_of_roofline'] else "") + " |",
                  f"| verify step (1 + D tokens) | {s['verify_ms']:.3f} | - | {s['verify_over_decode']:.2f}x decode |",
                  f"| draft loop (+ acceptance) | {s['draft_loop_ms']:.3f} | {s['draft_loop_roofline_ms']:.3f} | "
                  f"{s['draft_loop_over_roofline']:.2f}x roofline |",
                  f"| whole speculative step | {s['spec_step_ms']:.3f} | - | - |"]
    return "\n".join(lines)


def write_outputs(out: Path, result: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(result, indent=1, default=str))
    (out / "bench.md").write_text(table(result) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    series: dict = {}
    for r in result["rows"]:
        kind = r.get("speculative")
        name = r["engine"] + (f" + {kind}" if isinstance(kind, str) else " + spec" if kind else "")
        name += " (no overlap)" if r.get("overlap") is False else ""
        name += " (no prefix cache)" if r.get("prefix_caching") is False else ""
        series.setdefault(name, []).append((r["batch"], r["tokens_per_s"]))
    for name, pts in series.items():
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch size")
    ax.set_ylabel("output tokens / s")
    ax.set_title(f"{result['meta']['model']} on {result['meta']['device']}", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "bench.png", dpi=110)
    plt.close(fig)
