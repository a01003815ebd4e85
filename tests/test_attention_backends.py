"""FlexAttention (eager on the CPU) agrees with the SDPA reference, windows included. The Triton kernel and
compiled Flex on the GPU: tests/kernel_checks.py via tests/test_kernels.py."""

from __future__ import annotations

import torch

from specserve.kernels.attention import paged_attention_flex, paged_attention_sdpa


def test_flex_matches_sdpa_on_cpu():
    g = torch.Generator().manual_seed(5)
    kc, vc = (torch.randn(20, 16, 2, 32, generator=g) for _ in range(2))
    tables = torch.tensor([[3, 7, 1, 0], [5, 0, 0, 0]])
    qidx = torch.tensor([[0, 1, 2], [3, 6, 6]])  # row 1 has one query; 6 = T (padding)
    qpos = torch.tensor([[50, 51, 52], [9, 0, 0]])
    q = torch.randn(6, 4, 32, generator=g)
    args = (q, kc, vc, tables, qidx, qpos, 0.2)
    ref = paged_attention_sdpa(*args)
    got = paged_attention_flex(*args)
    assert torch.allclose(got[:4], ref[:4], atol=1e-5)
    for w in (4, 30):
        assert torch.allclose(paged_attention_flex(*args, sliding_window=w)[:4],
                              paged_attention_sdpa(*args, sliding_window=w)[:4], atol=1e-5)

