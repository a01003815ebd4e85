"""Llama-family decoder (Llama incl. llama3 RoPE scaling, Mistral, Qwen2, Qwen3, SmolLM2).

Weights are stored fused (qkv, gate+up); :meth:`LlamaForCausalLM.load_weights` takes tensors under
their Hugging Face names, so every loader (safetensors folder, GGUF) only has to produce those.
"""

from __future__ import annotations

import re
from typing import Iterable

import torch
from torch import nn

from specserve.config import ModelConfig
from specserve.distributed import SINGLE, TensorParallel
from specserve.kernels.rope import rope_and_cache
from specserve.models.attention import AttentionMetadata, paged_attention
from specserve.kernels.attention import AttnPartials
from specserve.kernels.gemv import (ADD_NORM, MERGE_FOLD, NONE, NORM, Prologue, fused_linear, linear_add_scaled,
                                    merged_linear, merges_splits)
from specserve.kernels.norm import embed_norm_cat
from specserve.kernels.qkv_rope import EMBED_CAT, qkv_rope_cache
from specserve.models.layers import RMSNorm, RotaryEmbedding, SwiGLU, VocabParallelEmbedding, linear


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, rope: RotaryEmbedding, in_features: int | None = None,
                 tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        # tensor parallelism: this rank's q and KV heads; the o projection's partial sums are added across ranks
        self.tp = tp
        self.hq = tp.shard(cfg.num_attention_heads, "attention heads")[1]
        self.hkv = tp.shard(cfg.num_key_value_heads, "KV heads")[1]
        self.d = cfg.head_dim
        in_features = in_features or cfg.hidden_size  # EAGLE-3's layer attends over [embed, hidden] (2H)
        self.qkv_proj = nn.Linear(in_features, (self.hq + 2 * self.hkv) * self.d, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.hq * self.d, cfg.hidden_size, bias=cfg.o_proj_bias)
        self.q_norm = RMSNorm(self.d, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.d, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.rope = rope
        self.scale = self.d ** -0.5

    def forward(self, x, positions, meta, k_cache, v_cache):
        """x [T, H]; positions [T] -> [T, H] over the paged cache (``meta``: AttentionMetadata).

        Training passes ``[B, S, H]`` inputs and a ``meta`` object with ``attend(q, k, v)`` (dense causal
        or training-time-test layouts, see ``specserve.train.attention``); no KV cache is used then.
        """
        return self.normed(x, positions, meta, k_cache, v_cache)[0]

    def normed(self, x, positions, meta, k_cache, v_cache, prologue: Prologue = NONE, residual=None, norm=None,
               embed=None, fold=None, stream=None, rows=None):
        """``forward`` of prologue(x) -> (output, x + residual for ADD_NORM, else None). ``prologue``, a
        ``Prologue``: NORM / ADD_NORM (the few-row GPU path): x normed by ``norm`` (after adding ``residual``);
        EMBED_CAT, ``embed`` = (ids [T], table [V, H], embedding norm): cat(embedding norm(table[ids]), norm(x)),
        a draft head's input. Where the kernel applies, the prologue, RoPE and the KV write all run inside the qkv
        projection. ``fold`` (the
        next RMSNorm, ``SwiGLU.norm_folds``): the output is (s, s * fold.weight), s = the o projection + the
        stream (``stream``, else x + residual, else x). ``rows`` = (index [N], layout), paged steps only: every
        token writes its KV, but attention and the o projection run for the flat tokens ``index`` only, as
        ``layout`` (AttentionMetadata of N one-query rows) says; the output has N rows, and a ``stream`` given
        is at those tokens already (a draft step 0, whose output is read at each row's last token)."""
        if isinstance(meta, AttentionMetadata):
            q, res = self.qkv_cached(x, positions, meta, k_cache, v_cache, prologue, residual, norm, embed)
            own = stream is not None
            fold, stream = _folded(fold, stream, res, x)
            idx = None
            if rows is not None:  # attention reads q at the N tokens idx in place
                idx, meta = rows
                stream = stream if own or stream is None else stream[idx]
            return self._attend(q, meta, k_cache, v_cache, fold, stream, idx), res
        # training's dense layouts (``meta.attend``): no cache
        qkv, res = self._qkv(x, prologue, residual, norm, embed)
        q, k, v = self._heads(qkv)
        q, k = self.rope(positions, q, k)
        out = meta.attend(q, k, v, self.scale)  # [..., Hq, D]
        return self._o_proj(out.reshape(*qkv.shape[:-1], self.hq * self.d), *_folded(fold, stream, res, x)), res

    def qkv_cached(self, x, positions, meta, k_cache, v_cache, prologue: Prologue = NONE, residual=None, norm=None,
                   embed=None):
        """The paged path's first half: the qkv projection of prologue(x) (as ``normed``), RoPE, and k and v
        written to the cache at ``meta.slot_mapping`` -> (rotated q [T, Hq, D], x + residual for ADD_NORM, else
        None); one kernel where the fused qkv + RoPE kernel applies."""
        if self.q_norm is None:
            nw, eps = (norm.weight, norm.eps) if norm is not None else (None, 0.0)
            fused = qkv_rope_cache(x, self.qkv_proj.weight, self.qkv_proj.bias, prologue, residual, nw, eps, positions,
                                   self.rope.cos_cache, self.rope.sin_cache, k_cache, v_cache, meta.slot_mapping,
                                   self.hq, self.hkv, self.d, None if embed is None else (*embed[:2], embed[2].weight))
            if fused is not None:
                return fused
        qkv, res = self._qkv(x, prologue, residual, norm, embed)
        q, k, v = self._heads(qkv)
        q = rope_and_cache(positions, q, k, v, self.rope.cos_cache, self.rope.sin_cache, k_cache, v_cache,
                           meta.slot_mapping)  # one kernel on CUDA
        return q, res

    def _qkv(self, x, prologue, residual, norm, embed):
        """The qkv projection of prologue(x) without the fused RoPE kernel -> (qkv [..., (Hq + 2 Hkv) * D],
        x + residual for ADD_NORM, else None)."""
        nw, eps = (norm.weight, norm.eps) if norm is not None else (None, 0.0)
        if prologue == EMBED_CAT:
            x, prologue = embed_norm_cat(embed[0], embed[1], embed[2].weight, x, nw, eps), NONE
        if prologue == NONE:
            return linear(self.qkv_proj, x), None
        return fused_linear(x, self.qkv_proj.weight, self.qkv_proj.bias, prologue, residual, nw, eps)

    def _heads(self, qkv):
        """qkv [..., (Hq + 2 Hkv) * D] -> q [..., Hq, D], k, v [..., Hkv, D] (q and k normed where the model
        has q/k norms)."""
        lead = qkv.shape[:-1]
        q, k, v = qkv.split([self.hq * self.d, self.hkv * self.d, self.hkv * self.d], dim=-1)
        q = q.view(*lead, self.hq, self.d)
        k = k.view(*lead, self.hkv, self.d)
        v = v.view(*lead, self.hkv, self.d)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v

    def _attend(self, q, meta, k_cache, v_cache, fold=None, stream=None, q_rows=None):
        """Rotated q [T, Hq, D] -> attention over the paged cache, then the o projection [T, H] (``_o_proj``);
        with ``q_rows`` [N], for the queries q[q_rows] only -> [N, H]."""
        t = q.shape[0] if q_rows is None else q_rows.shape[0]
        out = paged_attention(q, k_cache, v_cache, meta, self.scale, defer_merge=MERGE_FOLD and not self.tp.active,
                              q_rows=q_rows,
                              split_short=merges_splits(q, self.o_proj.weight, t))  # [T or N, Hq, D]
        if isinstance(out, AttnPartials):  # split keys: the o projection's kernel merges them, else the merge kernel
            folded = () if fold is None else (stream, fold.weight)
            o = merged_linear(out, self.o_proj.weight, self.o_proj.bias, *folded)
            if o is not None:
                return o if fold is not None else o[0]
            out = out.merge()
        return self._o_proj(out.reshape(out.shape[0], self.hq * self.d), fold, stream)

    def _o_proj(self, out, fold=None, stream=None):
        """out [..., Hq * D] -> the o projection [..., H]; with ``fold`` (an RMSNorm) and ``stream`` [..., H]:
        (o + stream, (o + stream) * fold.weight)."""
        if fold is not None:
            return linear_add_scaled(out, self.o_proj.weight, self.o_proj.bias, stream, fold.weight)
        return self.tp.all_reduce(linear(self.o_proj, out))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, rope: RotaryEmbedding, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, rope, tp=tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias, tp)

    def forward(self, x, residual, positions, meta, k_cache, v_cache, rows=None):
        """Returns (layer output before the residual add, residual); their sum is the stream. ``rows``: as
        ``Attention.normed`` (every token's KV, the output at those tokens only)."""
        return self.forward_with_input(x, residual, positions, meta, k_cache, v_cache, rows)[:2]

    def forward_with_input(self, x, residual, positions, meta, k_cache, v_cache, rows=None):
        """``forward``'s pair and the layer's input stream x + residual [T, H] (x for the first layer): the
        previous layer's output, an EAGLE-3 auxiliary hidden state, at no extra kernel (on the few-row path
        the qkv projection's prologue writes it)."""
        if self.mlp.few_row_path(x):  # few rows on the GPU: the input norm runs inside the qkv projection
            post = self.post_attention_layernorm
            fold = post if self.mlp.norm_folds(_row_count_view(x, rows)) else None
            h, res = self.self_attn.normed(x, positions, meta, k_cache, v_cache, NORM if residual is None else ADD_NORM,
                                           residual, self.input_layernorm, fold=fold, rows=rows)
            stream = x if residual is None else res  # [T, H]
            if fold is not None:  # h = (the stream after attention, it times post's weight)
                return self.mlp.from_stream(post, *h), h[0], stream
            return (*self.mlp.after_norm(post, h, at_rows(stream, rows)), stream)
        if residual is None:
            residual = x
            h = self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        return (*self.body(h, residual, positions, meta, k_cache, v_cache, rows), residual)

    def body(self, h, residual, positions, meta, k_cache, v_cache, rows=None):
        """The layer after its input norm: h = normed input stream, residual = the input stream itself."""
        h = self.self_attn.normed(h, positions, meta, k_cache, v_cache, rows=rows)[0]
        return self.mlp.after_norm(self.post_attention_layernorm, h, at_rows(residual, rows))


def at_rows(x: torch.Tensor, rows) -> torch.Tensor:
    """x [T, ...] at ``rows``' flat tokens [N, ...] (x itself without ``rows``)."""
    return x if rows is None else x[rows[0]]


def _row_count_view(x: torch.Tensor, rows) -> torch.Tensor:
    """A view of x [T, H] with as many rows as ``rows`` asks for (N <= T): the few-row kernels' choices depend on
    the row count, dtype and device only, so this asks them about the N-row tail without a gather."""
    return x if rows is None else x[:rows[0].shape[0]]


class LlamaForCausalLM(nn.Module):
    """The target model. ``forward`` returns final (normed) hidden states and, when asked, the
    residual-stream outputs of chosen layers (EAGLE-3 auxiliary hidden states). With ``tp`` (tensor
    parallelism) this rank's shard: its attention heads and MLP features, the rest replicated."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.config = cfg
        self.tp = tp
        rope = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
        # tensor parallelism: the embedding and the output layer by vocabulary rows (their logits gathered)
        self.embed_tokens = (VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp) if tp.active
                             else nn.Embedding(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg, rope, tp) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        vocab_rows = tp.vocab_shard(cfg.vocab_size)[1]
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, vocab_rows, bias=False)
        self.rope = rope

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        aux_layers: tuple[int, ...] = (),
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """input_ids [T]; positions [T] -> (hidden [T, H] after the final norm, aux [T, H] per aux layer).

        ``aux_layers`` are layer indices whose output (residual stream after the layer) is returned, one
        tensor per entry, in layer order (as vLLM / EAGLE concatenate them); a repeated id repeats its
        tensor (tiny models' default EAGLE-3 layers coincide). With none asked, no extra tensor is
        materialised.
        """
        x = self.embed_tokens(input_ids)
        residual = None
        captured: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.layers):
            if i - 1 in aux_layers:  # layer i - 1's output stream is the sum that this layer's input norm forms
                x, residual, captured[i - 1] = layer.forward_with_input(x, residual, positions, meta, *kv_caches[i])
            else:
                x, residual = layer(x, residual, positions, meta, *kv_caches[i])
        x, residual = self.norm(x, residual)
        captured[len(self.layers) - 1] = residual  # the last layer's output stream (used when asked)
        return x, [captured[i] for i in sorted(aux_layers)]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] -> logits [N, V] float32."""
        return self.lm_logits(hidden).float()

    def lm_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] -> logits [N, V] in the weights' dtype (under tensor parallelism every rank's part,
        gathered)."""
        logits = torch.nn.functional.linear(hidden, self.lm_weight())
        if not self.tp.active:
            return logits
        logits = self.tp.gather_last(logits)  # [N, size * rows]: the last rank's padding at the end
        return logits if logits.shape[-1] == self.config.vocab_size else logits[..., :self.config.vocab_size]

    def lm_weight(self) -> torch.Tensor:
        """The output projection [V, H] (the embedding when tied; under tensor parallelism this rank's rows)."""
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    # ----------------------------------------------------------------------------------------------
    # weight loading

    _STACKED = {
        "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }

    def _expected_names(self) -> set[str]:
        """Hugging Face tensor names this model needs."""
        cfg = self.config
        names = {"model.embed_tokens.weight", "model.norm.weight"}
        if not cfg.tie_word_embeddings:
            names.add("lm_head.weight")
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}."
            names |= {p + n for n in (
                "input_layernorm.weight", "post_attention_layernorm.weight",
                "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")}
            if cfg.attention_bias:
                names |= {p + f"self_attn.{n}_proj.bias" for n in "qkv"}
            if cfg.o_proj_bias:
                names.add(p + "self_attn.o_proj.bias")
            if cfg.mlp_bias:
                names |= {p + f"mlp.{n}_proj.bias" for n in ("gate", "up", "down")}
            if cfg.qk_norm:
                names |= {p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"}
        return names

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], source: str = "checkpoint") -> None:
        """Copy tensors given under Hugging Face names into the fused parameters.

        Raises ``ValueError`` naming the tensor when one is missing or has the wrong shape.
        Unknown extra tensors (e.g. rotary caches, MTP layers) are ignored.
        """
        cfg = self.config
        params = dict(self.named_parameters())
        expected = self._expected_names()
        seen: set[str] = set()
        hd, n = cfg.head_dim, self.tp.size
        split_sizes = {  # this rank's
            "qkv_proj": [cfg.num_attention_heads * hd // n, cfg.num_key_value_heads * hd // n,
                         cfg.num_key_value_heads * hd // n],
            "gate_up_proj": [cfg.intermediate_size // n, cfg.intermediate_size // n],
        }
        for name, tensor in weights:
            if name not in expected:
                continue
            seen.add(name)
            local = name[len("model."):] if name.startswith("model.") else name
            m = re.match(r"(layers\.\d+\.(?:self_attn|mlp)\.)(\w+)_proj\.(weight|bias)$", local)
            if self.tp.active:
                tensor = self._tp_shard(local, tensor)
            if m and m.group(2) + "_proj" in self._STACKED:
                fused, shard = self._STACKED[m.group(2) + "_proj"]
                target = params[m.group(1) + fused + "." + m.group(3)]
                sizes = split_sizes[fused]
                start = sum(sizes[:shard])
                part = target.data.narrow(0, start, sizes[shard])
                _copy_checked(part, tensor, name, source)
            else:
                _copy_checked(params[local].data, tensor, name, source)
        missing = sorted(expected - seen)
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise ValueError(f"{source}: missing tensor {missing[0]!r}{more}")


    def _tp_shard(self, local: str, tensor: torch.Tensor) -> torch.Tensor:
        """A checkpoint tensor (``local``: its name under the model) -> this rank's part of it: q/k/v and gate/up
        rows by heads / features, o and down columns likewise (their biases on rank 0 alone, zero elsewhere: the
        ranks' outputs are summed), the embedding and output layer by vocabulary rows; other tensors whole."""
        cfg, tp = self.config, self.tp
        if local in ("embed_tokens.weight", "lm_head.weight"):
            return self.embed_tokens.shard(tensor)
        kind = re.search(r"\.(q|k|v|gate|up|o|down)_proj\.(weight|bias)$", local)
        if kind is None:
            return tensor
        proj, what = kind.groups()
        units = {"q": cfg.num_attention_heads * cfg.head_dim, "k": cfg.num_key_value_heads * cfg.head_dim,
                 "v": cfg.num_key_value_heads * cfg.head_dim, "gate": cfg.intermediate_size,
                 "up": cfg.intermediate_size, "o": cfg.num_attention_heads * cfg.head_dim,
                 "down": cfg.intermediate_size}[proj]
        start, length = tp.shard(units, f"{proj}_proj features")
        if proj in ("o", "down"):
            if what == "bias":
                return tensor if tp.rank == 0 else torch.zeros_like(tensor)
            return tensor.narrow(1, start, length)
        return tensor.narrow(0, start, length)


def _folded(fold, stream, res, x) -> tuple:
    """``_attend``'s (fold, stream) for ``Attention.normed``: the stream is the caller's, else x + residual, else x."""
    if fold is None:
        return None, None
    return fold, stream if stream is not None else (res if res is not None else x)


def _copy_checked(dst: torch.Tensor, src: torch.Tensor, name: str, source: str) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(
            f"{source}: tensor {name!r} has shape {tuple(src.shape)}, expected {tuple(dst.shape)}"
        )
    dst.copy_(src.to(dst.dtype))
