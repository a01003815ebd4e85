"""Building ``AcceptInputs`` for hand-built acceptance tests."""

from __future__ import annotations

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
