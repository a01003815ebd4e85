"""GGUF loader: model config and tensors from a .gguf file through the ``gguf`` library.

Tensors are dequantized to float32 with ``gguf.quants.dequantize`` and renamed to Hugging Face names.
llama.cpp's converter permutes the rows of q/k projections of ``llama`` models into its interleaved
RoPE layout; this module undoes that so the tensors match the rotate-half layout of the HF model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from specserve.config import ModelConfig, RopeScaling

# GGUF architecture -> (HF architecture, q/k rows permuted by the converter)
GGUF_ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", True),
    "mistral": ("MistralForCausalLM", True),
    "qwen2": ("Qwen2ForCausalLM", False),
    "qwen3": ("Qwen3ForCausalLM", False),
}

SUPPORTED_QUANTS = (
    "F32", "F16", "BF16", "F64", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
)

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def hf_name(gguf_name: str) -> str | None:
    """GGUF tensor name -> Hugging Face name (None for tensors the model does not use)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}"
    return None


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """The row permutation llama.cpp's converter applies to q/k (rotate-half -> interleaved pairs)."""
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama_cpp_unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class GGUFFile:
    """An opened GGUF file: metadata, the model config, and HF-named float32 tensors."""

    def __init__(self, path: Path) -> None:
        from gguf import GGUFReader

        self.path = path
        try:
            self.reader = GGUFReader(str(path))
        except Exception as e:  # the library raises assorted errors on a corrupt file
            raise ValueError(f"{path}: not a readable GGUF file ({e})") from None
        arch = self.field("general.architecture")
        if arch not in GGUF_ARCHITECTURES:
            raise ValueError(
                f"{path}: general.architecture {arch!r} is not supported; specserve reads {sorted(GGUF_ARCHITECTURES)}"
            )
        self.arch = arch
        self.hf_arch, self.permuted_qk = GGUF_ARCHITECTURES[arch]
        self.tensors = {t.name: t for t in self.reader.tensors}
        self.config = self._config()

    def field(self, key: str, default=None, required: bool = True):
        f = self.reader.fields.get(key)
        if f is None:
            if required and default is None:
                raise ValueError(f"{self.path}: missing metadata field {key!r}")
            return default
        return f.contents()

    def _config(self) -> ModelConfig:
        a = self.arch
        heads = int(self.field(f"{a}.attention.head_count"))
        hidden = int(self.field(f"{a}.embedding_length"))
        vocab = self.field(f"{a}.vocab_size", required=False)
        if vocab is None:
            vocab = len(self.reader.fields["tokenizer.ggml.tokens"].data)
        rope = RopeScaling()
        if "rope_freqs.weight" in self.tensors:
            rope = RopeScaling(freq_factors=tuple(float(x) for x in self._array("rope_freqs.weight").ravel()))
        eos = self.field("tokenizer.ggml.eos_token_id", required=False)
        sliding = self.field(f"{a}.attention.sliding_window", required=False)
        return ModelConfig(
            architecture=self.hf_arch,
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(self.field(f"{a}.feed_forward_length")),
            num_hidden_layers=int(self.field(f"{a}.block_count")),
            num_attention_heads=heads,
            num_key_value_heads=int(self.field(f"{a}.attention.head_count_kv", heads)),
            head_dim=int(self.field(f"{a}.attention.key_length", hidden // heads)),
            rms_norm_eps=float(self.field(f"{a}.attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(self.field(f"{a}.rope.freq_base", 10000.0)),
            rope_scaling=rope,
            max_position_embeddings=int(self.field(f"{a}.context_length", 4096)),
            tie_word_embeddings="output.weight" not in self.tensors,
            attention_bias="blk.0.attn_q.bias" in self.tensors,
            o_proj_bias="blk.0.attn_output.bias" in self.tensors,
            qk_norm=a == "qwen3",
            sliding_window=int(sliding) if sliding else None,
            bos_token_id=self.field("tokenizer.ggml.bos_token_id", required=False),
            eos_token_ids=(int(eos),) if eos is not None else (),
        )

    def _array(self, name: str) -> np.ndarray:
        from gguf.quants import dequantize

        t = self.tensors[name]
        qtype = t.tensor_type.name
        if qtype not in SUPPORTED_QUANTS:
            raise ValueError(
                f"{self.path}: tensor {name!r} uses quantization {qtype}, which specserve cannot dequantize "
                f"(supported: {', '.join(SUPPORTED_QUANTS)})"
            )
        arr = dequantize(t.data, t.tensor_type)
        # GGUF lists dims fastest-first; the numpy view is already in row-major (HF) order.
        shape = tuple(int(x) for x in reversed(t.shape))
        return np.asarray(arr, dtype=np.float32).reshape(shape)

    def iter_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        cfg = self.config
        for name in self.tensors:
            target = hf_name(name)
            if target is None:
                continue
            arr = self._array(name)
            if self.permuted_qk and name.endswith(("attn_q.weight", "attn_q.bias")):
                arr = llama_cpp_unpermute(arr, cfg.num_attention_heads)
            elif self.permuted_qk and name.endswith(("attn_k.weight", "attn_k.bias")):
                arr = llama_cpp_unpermute(arr, cfg.num_key_value_heads)
            yield target, torch.from_numpy(np.array(arr, dtype=np.float32, order="C", copy=not arr.flags.writeable))
