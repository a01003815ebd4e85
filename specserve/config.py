"""Configuration objects: what the model is, how big the KV cache is, how the scheduler batches.

Every config validates itself on construction and raises ``ValueError`` with the field name.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

# Hugging Face ``architectures`` entries this engine runs, mapped to a family tag used by the loaders.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


@dataclass
class RopeScaling:
    """RoPE frequency scaling. Only ``llama3`` (and no scaling) are implemented."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # Per-frequency divisors stored by GGUF files as ``rope_freqs.weight`` (llama.cpp's form of llama3).
    freq_factors: tuple[float, ...] | None = None


@dataclass
class ModelConfig:
    """Shape of a Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, SmolLM2)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v projections (Qwen2: True)
    o_proj_bias: bool = False  # bias on o_proj (Llama/Qwen3 with ``attention_bias``; never Qwen2)
    mlp_bias: bool = False
    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE (Qwen3)
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; specserve runs "
                f"{sorted(SUPPORTED_ARCHITECTURES)}"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim"):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"model config field {name!r} must be positive, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )

    @property
    def family(self) -> str:
        return SUPPORTED_ARCHITECTURES[self.architecture]

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> "ModelConfig":
        """Build from a Hugging Face ``config.json`` dict (transformers v4 and v5 spellings)."""
        archs = cfg.get("architectures") or []
        if not archs:
            raise ValueError("config.json has no 'architectures' field; cannot tell which model this is")
        arch = archs[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"config.json: unsupported architecture {arch!r}; specserve runs {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
            if key not in cfg:
                raise ValueError(f"config.json: missing field {key!r}")
        heads = cfg["num_attention_heads"]
        # transformers v5 moves rope_theta/rope_scaling into "rope_parameters".
        rope = dict(cfg.get("rope_parameters") or {})
        scaling = cfg.get("rope_scaling") or {}
        rope_theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
        rtype = rope.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
        src = rope if rope.get("rope_type") not in (None, "default") else scaling
        if rtype not in ("default", "llama3"):
            raise ValueError(f"config.json: rope scaling type {rtype!r} is not supported (default, llama3)")
        rs = RopeScaling(rope_type=rtype)
        if rtype == "llama3":
            rs = RopeScaling(
                rope_type="llama3",
                factor=float(src["factor"]),
                low_freq_factor=float(src.get("low_freq_factor", 1.0)),
                high_freq_factor=float(src.get("high_freq_factor", 4.0)),
                original_max_position_embeddings=int(src.get("original_max_position_embeddings", 8192)),
            )
        family = SUPPORTED_ARCHITECTURES[arch]
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        sliding = cfg.get("sliding_window")
        # transformers: Qwen2 always has q/k/v biases and no o_proj bias, Mistral none; Llama and Qwen3
        # put ``attention_bias`` on q/k/v *and* o_proj.
        bias = bool(cfg.get("attention_bias", False))
        qkv_bias = {"qwen2": True, "mistral": False}.get(family, bias)
        o_bias = bias if family in ("llama", "qwen3") else False
        if family == "qwen2" or family == "qwen3":
            sliding = sliding if cfg.get("use_sliding_window", False) else None
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            rope_scaling=rs,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=qkv_bias,
            o_proj_bias=o_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=family == "qwen3",
            sliding_window=int(sliding) if sliding else None,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )


@dataclass
class CacheConfig:
    """Paged KV cache sizing.

    ``kv_cache_memory_bytes`` fixes the pool size; otherwise on CUDA the engine may use
    ``gpu_memory_utilization`` of the GPU's total memory (vLLM's meaning and default), and the pool takes what
    is left of that after the weights and a reserve for activations (``kv_cache.plan_num_blocks``); on the CPU
    it takes ``cpu_kv_cache_bytes`` (default 2 GiB).
    """

    block_size: int = 16
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    cpu_kv_cache_bytes: int = 2 << 30
    num_blocks: int | None = None  # exact block count; overrides the byte budget (tests use tiny pools)

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ValueError(f"kv_cache_memory_bytes must be positive, got {self.kv_cache_memory_bytes}")
        if self.num_blocks is not None and self.num_blocks < 2:
            raise ValueError(f"num_blocks must be at least 2 (one is reserved for padding), got {self.num_blocks}")


@dataclass
class SchedulerConfig:
    """Continuous batching limits.

    ``max_num_batched_tokens`` is the per-step token budget shared by prefill chunks and decodes;
    a prompt longer than the budget is prefilled in chunks (chunked prefill is always on).
    """

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # defaults to the model's max_position_embeddings

    def __post_init__(self) -> None:
        if self.max_num_seqs <= 0:
            raise ValueError(f"max_num_seqs must be positive, got {self.max_num_seqs}")
        if self.max_num_batched_tokens <= 0:
            raise ValueError(f"max_num_batched_tokens must be positive, got {self.max_num_batched_tokens}")
        if self.max_model_len is not None and self.max_model_len <= 0:  # None: the model's length
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}")


_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
}


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """``auto`` is bfloat16 on CUDA and float32 on the CPU."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use auto, float32, float16 or bfloat16")
    return _DTYPES[dtype]


def resolve_device(device: str | torch.device | None) -> torch.device:
    if device is None or device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError as e:  # an unknown device string: a user's error, said as one
        raise ValueError(f"unknown device {device!r} ({e})") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for but torch sees no CUDA device")
    return dev


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def blocks_for_bytes(budget: int, bytes_per_block: int) -> int:
    return max(0, math.floor(budget / bytes_per_block))
