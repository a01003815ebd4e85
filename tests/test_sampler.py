"""The device sampler on hand-built logits: filters, greedy rows, and the drawn distribution."""

from __future__ import annotations

import math

import torch

from specserve.runner.sampler import SamplingTensors, processed_logits, sample, uniform_noise


def tensors(n, temperature=1.0, top_k=None, top_p=1.0, min_p=0.0, seeds=None, offsets=None, vocab=8,
            needs_filter=True):
    return SamplingTensors(
        temperature=torch.full((n,), float(temperature)),
        top_k=torch.full((n,), top_k or vocab, dtype=torch.int64),
        top_p=torch.full((n,), float(top_p)),
        min_p=torch.full((n,), float(min_p)),
        seeds=torch.arange(n, dtype=torch.int64) if seeds is None else seeds,
        offsets=torch.zeros(n, dtype=torch.int64) if offsets is None else offsets,
        all_greedy=temperature == 0,
        needs_filter=needs_filter,
    )


LOGITS = torch.log(torch.tensor([[0.4, 0.25, 0.15, 0.1, 0.05, 0.03, 0.015, 0.005]]))


def kept(t: SamplingTensors) -> list[int]:
    return torch.isfinite(processed_logits(LOGITS, t)[0]).nonzero().flatten().tolist()


def test_filters_keep_the_expected_tokens():
    assert kept(tensors(1, top_k=3)) == [0, 1, 2]
    assert kept(tensors(1, top_p=0.6)) == [0, 1]  # 0.4 < 0.6 <= 0.65
    assert kept(tensors(1, top_p=0.39)) == [0]
    assert kept(tensors(1, top_p=0.41)) == [0, 1]
    assert kept(tensors(1, min_p=0.3)) == [0, 1, 2]  # p >= 0.12
    assert kept(tensors(1, top_k=5, top_p=0.99, min_p=0.2)) == [0, 1, 2, 3]
    assert kept(tensors(1, needs_filter=False)) == list(range(8))


def test_temperature_scales_logits():
    out = processed_logits(LOGITS, tensors(1, temperature=0.5, needs_filter=False))
    assert torch.allclose(out, LOGITS / 0.5)


def test_greedy_rows_take_the_argmax_in_a_mixed_batch():
    logits = torch.randn(6, 50)
    t = tensors(6, vocab=50, needs_filter=False)
    t.temperature = torch.tensor([0.0, 1.0, 0.0, 1.0, 0.0, 1.0])
    t.all_greedy = False
    out = sample(logits, t)
    assert out[[0, 2, 4]].tolist() == logits.argmax(-1)[[0, 2, 4]].tolist()


def test_noise_is_a_pure_function_of_seed_and_offset():
    a = uniform_noise(torch.tensor([5, 6]), torch.tensor([3, 3]), 100)
    b = uniform_noise(torch.tensor([6, 5]), torch.tensor([3, 3]), 100)
    assert torch.equal(a[0], b[1]) and not torch.equal(a[0], a[1])
    assert (a > 0).all() and (a < 1).all()


def test_sampled_frequencies_follow_the_distribution():
    n = 40000
    probs = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05])
    logits = probs.log().expand(n, -1).contiguous()
    t = tensors(n, vocab=5, needs_filter=False, seeds=torch.full((n,), 17, dtype=torch.int64),
                offsets=torch.arange(n, dtype=torch.int64))
    counts = torch.bincount(sample(logits, t), minlength=5).double()
    expected = probs.double() * n
    chi2 = (((counts - expected) ** 2) / expected).sum().item()
    assert chi2 < 20.5  # 4 d.o.f.: p ~ 4e-4 that a correct sampler exceeds this

    # with temperature 2 the distribution flattens to softmax(log p / 2)
    t.temperature = torch.full((n,), 2.0)
    counts = torch.bincount(sample(logits, t), minlength=5).double()
    flat = torch.softmax(probs.log() / 2, -1).double() * n
    assert (((counts - flat) ** 2) / flat).sum().item() < 20.5
    # and a top-k of 2 never draws outside the top 2, renormalised
    t.temperature = torch.ones(n)
    t.top_k = torch.full((n,), 2, dtype=torch.int64)
    t.needs_filter = True
    counts = torch.bincount(sample(logits, t), minlength=5).double()
    assert counts[2:].sum() == 0
    assert math.isclose(counts[0].item() / n, 0.5 / 0.7, abs_tol=0.01)
