"""``specserve bench``'s summaries of its rows: the median round of each engine, and the ratios between engines
(speculation over plain decoding, a tree over the chain, a switch on over off, specserve over transformers)."""

from __future__ import annotations

import statistics


def median_rounds(rows: list[dict]) -> list[dict]:
    """Rows of several rounds -> per (speculative, batch) the round with the median tokens/s, with every round's
    tokens/s in ``round_tokens_per_s`` (in round order). One round: the rows as they are."""
    groups: dict = {}
    for r in rows:
        groups.setdefault((r["speculative"], r.get("overlap"), r.get("prefix_caching"), r["batch"]), []).append(r)
    out = []
    for group in groups.values():
        med = dict(sorted(group, key=lambda r: r["tokens_per_s"])[len(group) // 2])
        if len(group) > 1:
            med["round_tokens_per_s"] = [r["tokens_per_s"] for r in group]
        out.append(med)
    return out


def ratios(rows: list[dict]) -> dict:
    """tokens/s ratios at each batch size: specserve (plain and speculative) over each baseline, and the overlap
    scheduler's gain where it ran both ways."""
    out: dict = {}
    mine = [r for r in rows if r["engine"] == "specserve"]
    for switch, label in (("overlap", "overlap"), ("prefix_caching", "prefix caching")):
        # the same engine with the switch on and off, the others at their defaults
        both = {(r["speculative"], r.get(switch, True), r["batch"]): r for r in mine
                if all(r.get(other, True) for other in ("overlap", "prefix_caching") if other != switch)}
        for (spec, on, b), r in both.items():
            off = both.get((spec, False, b))
            if on and off is not None:
                name = f"{engine_name(spec)} {label} on / off @ batch {b}"
                out[name] = r["tokens_per_s"] / off["tokens_per_s"]
                if "round_tokens_per_s" in r:
                    each = sorted(x / y for x, y in zip(r["round_tokens_per_s"], off["round_tokens_per_s"]))
                    out[f"{name}, median of {len(each)} rounds"] = statistics.median(each)
    # the baselines' ratios: the default engines
    rows = [r for r in rows if r.get("overlap", True) and r.get("prefix_caching", True)]
    by = {(r["engine"], r["speculative"], r["batch"]): r["tokens_per_s"] for r in rows}
    for (eng, spec, b), tps in by.items():
        if eng != "specserve":
            continue
        name = engine_name(spec)
        for base in ("transformers", "transformers+compile"):
            if (base, False, b) in by:
                out[f"{name} / {base} @ batch {b}"] = tps / by[(base, False, b)]
        for base in (False, True):  # over the plain engine; a tree's also over the chain
            if spec and spec is not base and ("specserve", base, b) in by:
                out[f"{name} / {engine_name(base)} @ batch {b}"] = tps / by[("specserve", base, b)]
    # rounds: the ratio within each round (the engines ran one after the other), their median
    rounds = {(r["speculative"], r["batch"]): r["round_tokens_per_s"] for r in rows if "round_tokens_per_s" in r}
    for (spec, b), tps in rounds.items():
        for base in (False, True):
            if spec and spec is not base and (base, b) in rounds:
                each = sorted(s / p for s, p in zip(tps, rounds[(base, b)]))
                out[f"{engine_name(spec)} / {engine_name(base)} @ batch {b}, median of {len(each)} rounds"] = \
                    statistics.median(each)
    return out


def spec_label(kind) -> str:
    """A row's ``speculative`` in words: off, on (the chain) or the tree's shape."""
    return kind if isinstance(kind, str) else ("on" if kind else "off")


def engine_name(kind) -> str:
    return "specserve" if not kind else ("specserve+spec" if kind is True else f"specserve+{kind}")
