"""A draft head's output layer as int8 rows (``quantize_rows``): the quantization, its reference path (the one
the CPU takes: the few-row kernel that reads int8 runs on the GPU and in ``kernel_checks.py``), and the head's
per-weight cache of the quantized table."""

from __future__ import annotations

import torch

from specserve.config import ModelConfig
from specserve.kernels.gemv import NORM, fused_linear, linear_ref, quantize_rows
from specserve.speculative.random_heads import random_head


def test_quantize_rows_is_within_half_a_step_of_each_row():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(40, 24, generator=g) * torch.linspace(0.01, 3.0, 40)[:, None]
    w[7] = 0.0  # an all-zero row keeps a finite scale
    q, scale = quantize_rows(w)
    assert q.dtype == torch.int8 and scale.shape == (40,) and torch.isfinite(scale).all()
    assert q.abs().max() <= 127
    err = (q.float() * scale[:, None] - w).abs()
    assert (err <= scale[:, None] / 2 + 1e-6).all()
    assert (q.abs().amax(dim=1)[torch.arange(40) != 7] == 127).all()  # each row uses the full range


def test_int8_weights_off_the_kernel_path_are_dequantized():
    g = torch.Generator().manual_seed(1)
    w, x, nw = torch.randn(30, 16, generator=g), torch.randn(1, 16, generator=g), torch.rand(16, generator=g) + 0.5
    q, scale = quantize_rows(w)
    out, _ = fused_linear(x, q, None, NORM, norm_weight=nw, eps=1e-5, scale=scale)
    ref, _ = linear_ref(x, q.float() * scale[:, None], None, NORM, norm_weight=nw, eps=1e-5)
    torch.testing.assert_close(out, ref)


def _cfg() -> ModelConfig:
    return ModelConfig(architecture="LlamaForCausalLM", vocab_size=64, hidden_size=16, intermediate_size=32,
                       num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                       max_position_embeddings=64)


def test_a_head_quantizes_each_output_layer_once_per_version():
    head = random_head(_cfg(), "eagle3", own_head=True)
    w = head.lm_weight()
    get = head.int8_output(w)
    first = get()
    assert get() is first and head.int8_output(w)() is first  # cached, not remade per draft step
    torch.testing.assert_close(first[0].float() * first[1][:, None], w.float(), atol=first[1].max().item(), rtol=0)
    with torch.no_grad():
        w.mul_(2.0)  # an edit in place (a reload): a new table
    second = head.int8_output(w)()
    assert second is not first
    torch.testing.assert_close(second[1], 2 * first[1])


def test_the_argmax_table_folds_the_norm_weight_in_and_gives_the_normed_logits_up_to_one_factor():
    """Drafts read ``int8_output(w, norm)``: the rows times the norm's weight, no norm prologue. A row's logits
    are then the normed logits divided by its RMS factor (one positive number per row: the argmax stays)."""
    head = random_head(_cfg(), "eagle3", own_head=True)
    w, norm = head.lm_weight(), head.norm
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 2.0, norm.weight.numel()))
    folded = head.int8_output(w, norm)()
    assert folded is head.int8_output(w, norm)() and folded is not head.int8_output(w)()  # its own cached table
    q, scale = folded
    deq = q.float() * scale[:, None]
    assert ((deq - w.float() * norm.weight.float()).abs() <= scale[:, None] / 2 + 1e-6).all()
    x = torch.randn(5, w.shape[1], generator=torch.Generator().manual_seed(3))
    rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps)
    torch.testing.assert_close(x @ deq.T * rstd, norm(x) @ w.float().T, atol=0.05, rtol=0.02)
    with torch.no_grad():
        norm.weight.mul_(2.0)  # a new norm weight: a new table
    assert head.int8_output(w, norm)() is not folded


def test_only_heads_with_one_norm_per_output_weight_fold_it():
    """Vanilla MTP's modules share one output layer under their own norms: folding would make a table per module."""
    from specserve.speculative.heads import MTPHead

    cfg = _cfg()
    assert random_head(cfg, "eagle3").fold_draft_norm
    assert MTPHead(cfg, 1, own_head=False, eagle=True).fold_draft_norm  # MTP-Eagle: one module, one norm
    assert MTPHead(cfg, 1, own_head=False, eagle=False).fold_draft_norm
    assert not MTPHead(cfg, 3, own_head=False, eagle=False).fold_draft_norm
