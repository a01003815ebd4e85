"""Random draft heads with a target's shapes, for benchmarks (timings do not depend on the weights)
and for tests (losslessness must hold whatever the head drafts)."""

from __future__ import annotations

import torch

from specserve.config import ModelConfig
from specserve.speculative.config import default_eagle3_layers
from specserve.speculative.heads import DraftHead, Eagle3Head, MTPHead


def random_head(cfg: ModelConfig, method: str = "eagle3", draft_vocab: int | None = None, num_modules: int = 1,
                own_head: bool = True, seed: int = 0) -> DraftHead:
    """EAGLE-3 (with a random draft vocabulary of ``draft_vocab`` target ids; ``own_head`` False: the target's
    lm_head, all of it or its rows at those ids) or MTP (``num_modules`` modules) with random weights and
    perturbed norms."""
    torch.manual_seed(seed)
    if method == "eagle3":
        dv = (draft_vocab or cfg.vocab_size) if own_head else draft_vocab
        head: DraftHead = Eagle3Head(cfg, default_eagle3_layers(cfg.num_hidden_layers), dv, shared_lm_head=not own_head)
        if dv is not None and dv < cfg.vocab_size:
            ids = torch.randperm(cfg.vocab_size)[:dv].sort().values
            head.d2t.copy_(ids - torch.arange(dv))
    elif method == "mtp":
        head = MTPHead(cfg, num_modules, own_head=own_head, eagle=True)
    else:
        raise ValueError(f"unknown head method {method!r}")
    with torch.no_grad():
        for name, p in head.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return head
