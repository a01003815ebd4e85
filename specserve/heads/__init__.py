"""Draft heads shipped with specserve for the embedded default model (trained by ``specserve train-draft``)."""

from __future__ import annotations

from pathlib import Path

HEADS_DIR = Path(__file__).parent
DEFAULT_HEADS = {
    "eagle3": HEADS_DIR / "smollm2-135m-eagle3",
    "mtp": HEADS_DIR / "smollm2-135m-mtp-eagle",
}


def default_speculative_config(method: str = "eagle3", max_draft_len: int = 4) -> dict:
    """Speculative config that uses the shipped head of ``method`` for the default model."""
    if method not in DEFAULT_HEADS:
        raise ValueError(f"no shipped head for method {method!r}; shipped: {sorted(DEFAULT_HEADS)}")
    return {"method": method, "draft_model": str(DEFAULT_HEADS[method]), "max_draft_len": max_draft_len}
