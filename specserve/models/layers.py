"""Building blocks of a Llama-family decoder: RMSNorm, rotary embedding, SwiGLU MLP, the vocabulary-parallel
embedding."""

from __future__ import annotations

import math

import torch
from torch import nn

from specserve.config import RopeScaling
from specserve.distributed import SINGLE, TensorParallel
from specserve.kernels.activation import silu_and_mul
from specserve.kernels.argmax import argmax_lastdim
from specserve.kernels.gemv import (ADD_NORM, NORM, SILU_MUL, SILU_MUL_RSTD, fused_argmax, fused_linear, gemv_enabled,
                                    takes_kernel)
from specserve.kernels.gemv_rows import rows_linear, rows_takes
from specserve.kernels.norm import rms_norm
from specserve.kernels.rope import rope_ref


def linear(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``layer(x)``; a few-row step on the GPU takes one kernel of ``specserve.kernels.gemv`` instead of cuBLAS."""
    if gemv_enabled(x, layer.in_features):
        return fused_linear(x, layer.weight, layer.bias)[0]
    return layer(x)


# The one-row int8 output layer's launch: 32 features per program, 4 warps (the best of the H200 sweep of
# benchmarks/bench_lm_head.py)
_LM_LAUNCH = dict(block=32, num_warps=4)


def normed_logits(norm: "RMSNorm", x: torch.Tensor, weight: torch.Tensor, int8=None) -> torch.Tensor:
    """x [N, H] -> norm(x) @ weight.T [N, V'] in x's dtype: a draft head's output layer, one kernel for one row
    on the GPU (the norm inside the projection) instead of a norm and a GEMM. Several rows keep cuBLAS: the
    few-row kernel reads the weights once per row, and an output layer (56.6 MB for the default model) does
    not stay in L2 between rows. ``int8``: a callable giving ``quantize_rows(weight)``, which the one-row
    kernel then reads instead (half the bytes of bfloat16; drafts only, whose logits need only their argmax)."""
    if x.dim() == 2 and x.shape[0] == 1 and gemv_enabled(x, x.shape[-1]):
        if int8 is not None:
            q, scale = int8()
            return fused_linear(x, q, None, NORM, norm_weight=norm.weight, eps=norm.eps, scale=scale,
                                **_LM_LAUNCH)[0]
        return fused_linear(x, weight, None, NORM, norm_weight=norm.weight, eps=norm.eps)[0]
    return nn.functional.linear(norm(x), weight)


def normed_argmax(norm: "RMSNorm", x: torch.Tensor, weight: torch.Tensor, int8=None, ids=None, out=None,
                  int8_folded=None) -> torch.Tensor:
    """x [N, H] -> the argmax of ``normed_logits(norm, x, weight)`` per row [N] int64 (``ids`` [V']: the target id
    at that index), ties to the lowest index. One row on the GPU: the output layer's kernel writes each program's
    best logit instead of the logits, and a second kernel picks among them, into ``out`` [N] when given (elsewhere
    the result is a new tensor: the caller copies). That kernel reads, first found: ``int8_folded`` (a callable
    giving ``quantize_rows(weight * norm.weight)``), without the norm: RMSNorm scales a row's logits by one
    positive factor, which leaves their argmax where it is, and its weight folds into the rows (not in float16,
    whose range the unnormed logits could leave); ``int8`` (``quantize_rows(weight)``) with the norm in its
    prologue; the weight itself. Drafts only: int8 rows, and the norm's rounding left out, can move a near-tie."""
    if x.dim() == 2 and x.shape[0] == 1 and gemv_enabled(x, x.shape[-1]):
        if int8_folded is not None and x.dtype != torch.float16:
            q, scale = int8_folded()
            return fused_argmax(x, q, scale=scale, ids=ids, out=out, **_LM_LAUNCH)
        if int8 is not None:
            q, scale = int8()
            return fused_argmax(x, q, NORM, norm.weight, norm.eps, scale=scale, ids=ids, out=out, **_LM_LAUNCH)
        return fused_argmax(x, weight, NORM, norm.weight, norm.eps, ids=ids, out=out)
    return argmax_lastdim(normed_logits(norm, x, weight), ids)


class VocabParallelEmbedding(nn.Module):
    """An embedding table split by vocabulary rows over the tensor-parallel ranks (``TensorParallel.vocab_shard``):
    each rank looks up the ids it holds, zeros for the others, and the ranks' rows are summed. ``weight`` [rows, H]
    is this rank's part, padded with zero rows past the vocabulary; a tied output layer reads it as its own part."""

    def __init__(self, vocab: int, hidden: int, tp: TensorParallel) -> None:
        super().__init__()
        self.tp, self.num_embeddings = tp, vocab
        self.start, rows = tp.vocab_shard(vocab)
        self.weight = nn.Parameter(torch.zeros(rows, hidden))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [...] -> [..., H]"""
        local = ids - self.start
        held = (local >= 0) & (local < self.weight.shape[0])
        x = nn.functional.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight)
        return self.tp.all_reduce(x.masked_fill(~held.unsqueeze(-1), 0))

    def shard(self, full: torch.Tensor) -> torch.Tensor:
        """A checkpoint's whole table (or output layer) [V, H] -> this rank's rows, zero-padded [rows, H]."""
        part = full[self.start:self.start + self.weight.shape[0]]
        return torch.cat([part, part.new_zeros(self.weight.shape[0] - part.shape[0], part.shape[1])])


class RMSNorm(nn.Module):
    """RMSNorm computed in float32, with an optional fused residual add.

    ``forward(x)`` returns the normed tensor. ``forward(x, residual)`` first adds ``x`` to
    ``residual`` and returns ``(normed, new_residual)``; this keeps the residual stream explicit so
    that callers can read it (EAGLE-3 auxiliary hidden states) without extra copies.
    """

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        return rms_norm(x, self.weight, self.eps, residual)


def _llama3_inv_freq(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    """Llama 3.1 frequency scaling: long wavelengths are divided by ``factor``, short ones kept,
    and the band in between is interpolated smoothly (Meta's published formula)."""
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    mid = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_mid, mid, scaled)


class RotaryEmbedding(nn.Module):
    """Rotate-half (NeoX layout) RoPE with a precomputed cos/sin table indexed by position."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: RopeScaling) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        if scaling.rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, scaling)
        if scaling.freq_factors is not None:
            inv_freq = inv_freq / torch.tensor(scaling.freq_factors, dtype=torch.float32)
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)  # [max_positions, head_dim/2]
        self.register_buffer("cos_cache", freqs.cos(), persistent=False)
        self.register_buffer("sin_cache", freqs.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """positions [...]; q [..., Hq, D]; k [..., Hkv, D] -> rotated (q, k) (training's dense path;
        the paged path fuses RoPE with the cache write, ``specserve.kernels.rope``)."""
        return rope_ref(positions, q, k, self.cos_cache, self.sin_cache)


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))`` with gate and up fused into one matmul."""

    def __init__(self, hidden: int, intermediate: int, bias: bool, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        # tensor parallelism: this rank's intermediate features; the down projection's partial sums are added
        # across ranks (its bias held by rank 0 alone)
        self.tp = tp
        intermediate = tp.shard(intermediate, "MLP intermediate features")[1]
        self.intermediate = intermediate
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., H] -> [..., H]; with ``residual`` (a tensor of the caller's own, which it gives up) the
        result plus ``residual``: the down projection adds it in place (one GEMM instead of a GEMM and an add)
        when nothing records gradients and there is no bias."""
        act = silu_and_mul(self.gate_up_proj(x))  # [..., I]
        if self.tp.active:  # the residual once, after the ranks' sum
            out = self.tp.all_reduce(self.down_proj(act))
            return out if residual is None else out + residual
        if residual is None:
            return self.down_proj(act)
        if torch.is_grad_enabled() or self.down_proj.bias is not None or not residual.is_contiguous():
            return self.down_proj(act) + residual
        h = residual.shape[-1]
        return residual.view(-1, h).addmm_(act.reshape(-1, act.shape[-1]), self.down_proj.weight.t()).view(
            residual.shape)

    def few_row_path(self, x: torch.Tensor) -> bool:
        """Whether a step with input x [T, H] runs this MLP (and its layer) on the few-row kernels (not under
        tensor parallelism: their fused residual adds and norm folds need the ranks' sums in between)."""
        return not self.tp.active and gemv_enabled(x, max(self.gate_up_proj.in_features, self.intermediate))

    def after_norm(self, norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor):
        """x, residual [T, H] -> (self(norm(x + residual)), x + residual): four kernels, or two on the
        few-row GPU path (the norm inside the gate/up projection, the activation inside the down one)."""
        if not self.few_row_path(x):
            h, residual = norm(x, residual)
            return self(h), residual
        gu, residual = self._normed_gate_up(norm, x, residual)
        return fused_linear(gu, self.down_proj.weight, self.down_proj.bias, SILU_MUL)[0], residual

    def after_norm_sum(self, norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """``sum(after_norm(...))``: the MLP's output added to the new residual stream (taken over)."""
        if not self.few_row_path(x):
            h, residual = norm(x, residual)
            return self(h, residual)
        gu, residual = self._normed_gate_up(norm, x, residual)
        return fused_linear(gu, self.down_proj.weight, self.down_proj.bias, SILU_MUL, add=residual)[0]

    def norm_folds(self, x: torch.Tensor) -> bool:
        """Whether a few-row step with input x [T, H] runs its gate/up projection without a norm prologue, so the
        norm before it folds into its neighbours instead of running as a kernel of its own: the o projection
        writes the stream s and s * the norm's weight, the gate/up projection takes the latter, and the down
        projection scales gate and up by 1 / rms(s) (``from_stream``). So it does where the step has too many
        rows for the one-row-per-program kernel (cuBLAS runs gate/up: a step of 6-8 rows of the default model,
        or a wider model's verify step), or where the kernel reading each weight block once for all rows takes
        it (``gemv_rows``: that kernel with the norm in its prologue instead timed slower). Not in float16: the
        gate/up outputs are rms(s) times gate/up's, which a large stream could take past its range."""
        gu = self.gate_up_proj
        return (x.dtype != torch.float16 and self.few_row_path(x) and gu.bias is None
                and (rows_takes(x, gu.weight) or not takes_kernel(gu.out_features, gu.in_features, x.shape[0])))

    def from_stream(self, norm: RMSNorm, s: torch.Tensor, scaled: torch.Tensor, add_stream: bool = False):
        """``self(norm(s))`` (+ s with ``add_stream``) where ``norm_folds``: s [T, H] is the stream, ``scaled``
        s * norm.weight [T, H]; norm(s) = scaled / rms(s) row by row, so gate_up(norm(s)) = gate_up(scaled) /
        rms(s), applied in the down projection's prologue. Two kernels for a norm, a GEMM and the down one; the GEMM
        is ``gemv_rows``'s kernel where that takes it, else cuBLAS."""
        gu = rows_linear(scaled, self.gate_up_proj.weight)  # [T, 2I], rms(s) times gate/up (or F.linear)
        return fused_linear(gu, self.down_proj.weight, self.down_proj.bias, SILU_MUL_RSTD, s, None, norm.eps,
                            add=s if add_stream else None)[0]

    def _normed_gate_up(self, norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor):
        """The few-row path's first kernel: (gate_up(norm(x + residual)) [T, 2I], x + residual)."""
        return fused_linear(x, self.gate_up_proj.weight, self.gate_up_proj.bias, ADD_NORM, residual, norm.weight,
                            norm.eps)
