"""Per-layer kernel costs from one step's device timeline (``benchmarks/profile_step.py --timeline``).

With programmatic dependent launch a step's kernels overlap, so their durations overstate what each costs the
step. A kernel's cost here is how far it moves the latest kernel end of the step so far.
"""

from __future__ import annotations


def layer_costs(order: list[dict], first: str = "_qkv") -> tuple[list[tuple[str, float]], int]:
    """One step's kernels in launch order -> the mean cost (µs) of each kernel of a decoder layer, and the
    number of layers averaged.

    ``order``: dicts with ``name``, ``us`` (the kernel's duration) and ``gap_us`` (its start minus the end of
    the kernel launched before it; negative where they overlap). A layer runs from one kernel whose name starts
    with ``first`` to the next such kernel, so the last layer, followed by the output layer, is left out.
    """
    cost, prev_end, latest = [], 0.0, 0.0
    for i, k in enumerate(order):
        start = prev_end + k["gap_us"] if i else 0.0
        prev_end = start + k["us"]
        cost.append(max(0.0, prev_end - latest))
        latest = max(latest, prev_end)
    starts = [i for i, k in enumerate(order) if k["name"].startswith(first)]
    layers = [range(a, b) for a, b in zip(starts, starts[1:])]
    if not layers:
        return [], 0
    width = min(len(r) for r in layers)
    means = [(order[layers[0][j]]["name"], sum(cost[r[j]] for r in layers) / len(layers)) for j in range(width)]
    return means, len(layers)


def format_layer_costs(order: list[dict]) -> str | None:
    """``layer_costs`` as one line (each kernel's cost and the layer's sum), or None without a whole layer."""
    means, n = layer_costs(order)
    if not n:
        return None
    parts = ", ".join(f"{name[:24]} {us:.2f}" for name, us in means)
    return f"a layer's kernels, cost in us (mean of {n} layers): {parts}; layer {sum(u for _, u in means):.2f}"
