"""The norm before a gate/up projection folded into its neighbours (``SwiGLU.norm_folds`` / ``from_stream``):
the same MLP, when it is taken, and the same greedy tokens from the engine. On the CPU the fold runs its
PyTorch references (the kernels are checked in ``kernel_checks.check_norm_fold``); the engine test makes the
CPU take the few-row layer path so that the fold's plumbing (decoder layers, EAGLE-3 and MTP heads) runs."""

from __future__ import annotations

import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.kernels.gemv import linear_add_scaled
from specserve.models import layers
from specserve.models.layers import RMSNorm, SwiGLU
from tiny_models import PROMPTS, make_head, make_hf_model


def _mlp(h: int, i: int, bias: bool = False, seed: int = 0) -> tuple[SwiGLU, RMSNorm]:
    g = torch.Generator().manual_seed(seed)
    mlp, norm = SwiGLU(h, i, bias), RMSNorm(h, 1e-5)
    with torch.no_grad():
        for p in list(mlp.parameters()) + [norm.weight]:
            p.copy_(torch.randn(p.shape, generator=g) / (p.shape[-1] ** 0.5 if p.dim() == 2 else 3) + (p.dim() == 1))
    return mlp, norm


@torch.no_grad()
@pytest.mark.parametrize("t", [1, 5])
def test_the_folded_mlp_is_the_mlp_after_the_norm(t):
    mlp, norm = _mlp(48, 80)
    g = torch.Generator().manual_seed(1)
    attn, w_o = torch.randn(t, 32, generator=g), torch.randn(48, 32, generator=g) / 6
    stream = 3 * torch.randn(t, 48, generator=g)  # a stream far from unit scale: 1 / rms matters
    s, scaled = linear_add_scaled(attn, w_o, None, stream, norm.weight)
    o = attn @ w_o.T
    torch.testing.assert_close(s, o + stream)
    torch.testing.assert_close(scaled, norm.weight * s)
    want, want_s = mlp.after_norm(norm, o, stream)
    torch.testing.assert_close(s, want_s)
    torch.testing.assert_close(mlp.from_stream(norm, s, scaled), want)
    torch.testing.assert_close(mlp.from_stream(norm, s, scaled, add_stream=True), mlp.after_norm_sum(norm, o, stream))


def test_the_fold_is_taken_only_where_gate_up_runs_without_a_norm_prologue(monkeypatch):
    """Where gate/up leaves the one-row kernel (cuBLAS), or where the several-row kernel takes it."""
    x = torch.zeros(5, 48, dtype=torch.bfloat16)
    mlp, _ = _mlp(48, 80)
    biased, _ = _mlp(48, 80, bias=True)
    assert not mlp.norm_folds(x)  # the CPU: no few-row path
    monkeypatch.setattr(SwiGLU, "few_row_path", lambda self, x: True)
    monkeypatch.setattr(layers, "takes_kernel", lambda n, k, t: t < 3)
    assert mlp.norm_folds(x) and not mlp.norm_folds(x[:2])  # 5 rows leave the gate/up kernel, 2 do not
    assert not biased.norm_folds(x)  # a gate/up bias cannot be added after the 1 / rms scaling
    assert not mlp.norm_folds(x.half())  # float16: rms(s) * gate/up could overflow
    monkeypatch.setattr(layers, "rows_takes", lambda x, w: x.shape[0] == 2)  # gemv_rows' kernel takes gate/up
    assert mlp.norm_folds(x[:2]) and not biased.norm_folds(x[:2])


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("fold")
    make_hf_model(root / "t", "llama", initializer_range=0.4, num_hidden_layers=3)
    make_head(root / "e3", root / "t", "eagle3", own_head=False, seed=1)
    make_head(root / "mtp", root / "t", "mtp", num_modules=1, seed=2)
    return root


@pytest.mark.parametrize("spec", [None, dict(method="eagle3", draft_model="e3", max_draft_len=3),
                                  dict(method="mtp", draft_model="mtp", max_draft_len=2)], ids=["plain", "eagle3", "mtp"])
def test_the_engine_with_the_norm_folded_gives_the_same_greedy_tokens(dirs, spec, monkeypatch):
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)

    def tokens() -> list[list[int]]:
        s = None if spec is None else dict(spec, draft_model=str(dirs / spec["draft_model"]))
        llm = LLM(str(dirs / "t"), device="cpu", dtype="float32", max_num_batched_tokens=9, speculative_config=s)
        return [o.token_ids for o in llm.generate(PROMPTS[:3], sp)]

    want = tokens()
    calls = []
    monkeypatch.setattr(SwiGLU, "few_row_path", lambda self, x: x.dim() == 2 and x.shape[0] <= 8)
    monkeypatch.setattr(layers, "takes_kernel", lambda n, k, t: False)  # every few-row step folds
    from_stream = SwiGLU.from_stream
    monkeypatch.setattr(SwiGLU, "from_stream", lambda self, *a, **k: calls.append(1) or from_stream(self, *a, **k))
    assert tokens() == want
    assert calls  # the folded path ran
