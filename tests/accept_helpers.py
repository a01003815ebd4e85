"""Building ``AcceptInputs`` for hand-built acceptance tests; sampled replies of a small-vocabulary model and the
chi-square test of two samples, for tests of sampled acceptance through the engine."""

from __future__ import annotations

import math
from collections import Counter

import torch

from specserve.runner.sampler import SamplingTensors
from specserve.speculative.accept import AcceptInputs


def inputs(b: int, can=None, temperature=0.0, seeds=None, offsets=None, relaxed=False, topk=1, delta=0.0,
           thinking=False, begin=-1, end=-1, vocab=10, top_k=None, top_p=1.0, remove_rejected=True) -> AcceptInputs:
    def col(x, dtype):
        return x if isinstance(x, torch.Tensor) else torch.full((b,), x, dtype=dtype)

    temp = col(float(temperature), torch.float32)
    sampling = SamplingTensors(
        temperature=temp, top_k=col(top_k or vocab, torch.int64), top_p=col(float(top_p), torch.float32),
        min_p=col(0.0, torch.float32), seeds=col(0, torch.int64) if seeds is None else seeds,
        offsets=col(0, torch.int64) if offsets is None else offsets,
        all_greedy=bool((temp == 0).all()), needs_filter=top_k is not None or top_p < 1.0)
    relaxed_t = col(relaxed, torch.bool)
    return AcceptInputs(
        sampling=sampling, greedy=temp == 0, can_accept=col(True, torch.bool) if can is None else can,
        relaxed=relaxed_t, relaxed_topk=col(topk, torch.int64), relaxed_delta=col(float(delta), torch.float32),
        thinking=col(thinking, torch.bool), begin_token=begin, end_token=end, max_topk=int(topk),
        simple_greedy=bool((temp == 0).all()) and not bool(relaxed_t.any()), remove_rejected=remove_rejected)


def greedy_inputs(b: int, can=None) -> AcceptInputs:
    return inputs(b, can=can)


def chi2_homogeneity(a: Counter, b: Counter, min_count: int = 10) -> tuple[float, int]:
    keys = set(a) | set(b)
    big = [k for k in keys if a[k] + b[k] >= min_count]
    cells = [(a[k], b[k]) for k in big]
    cells.append((sum(a[k] for k in keys if k not in big), sum(b[k] for k in keys if k not in big)))
    na, nb = sum(a.values()), sum(b.values())
    stat = 0.0
    for x, y in cells:
        tot = x + y
        if tot == 0:
            continue
        for obs, n in ((x, na), (y, nb)):
            exp = tot * n / (na + nb)
            stat += (obs - exp) ** 2 / exp
    return stat, len(cells) - 1


def chi2_critical(dof: int, z: float = 3.09) -> float:
    """Upper 0.1% point of chi-square (Wilson-Hilferty)."""
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


def make_small_vocab(root):
    """An 8-token-vocabulary Llama in ``root/t`` and an MTP head for it in ``root/h``: few enough outcomes that a few
    thousand replies estimate their distribution."""
    from tiny_models import make_head, make_hf_model

    make_hf_model(root / "t", "llama", vocab_size=8, initializer_range=0.3, num_hidden_layers=2)
    make_head(root / "h", root / "t", "mtp", num_modules=1, seed=5)
    return root


def sample_replies(root, spec: dict | None, n: int, prompt: list[int], seed: int = 0, biased: bool = False,
                   setup=None):
    """``n`` 3-token replies to ``prompt`` at temperature 1, seeds ``seed`` + i, with the MTP head of
    ``make_small_vocab`` and ``spec``'s settings (None: no speculation); ``biased``: the sampler keeps rejected
    drafts in the bonus distribution; ``setup``: called with the LLM before it generates -> (outputs, the
    engine's speculation statistics)."""
    from specserve import LLM, SamplingParams

    cfg = None if spec is None else dict(method="mtp", draft_model=str(root / "h"), **spec)
    llm = LLM(str(root / "t"), device="cpu", dtype="float32", max_num_seqs=512, num_kv_blocks=1500,
              speculative_config=cfg)
    if biased:
        llm.engine.runner.speculator.verifier.remove_rejected = False
    if setup is not None:
        setup(llm)
    params = [SamplingParams(temperature=1.0, seed=seed + i, max_tokens=3, ignore_eos=True) for i in range(n)]
    return llm.generate([prompt] * n, params), llm.engine.spec_stats

