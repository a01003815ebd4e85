"""Configuration objects: what the model is, how big the KV cache is, how the scheduler batches, and the one
engine configuration that holds them.

The path is one way: CLI flags or ``LLM(...)`` keyword arguments -> ``EngineArgs`` (the user's values, vLLM's
names) -> ``EngineArgs.create_engine_config()`` -> ``EngineConfig`` (validated; the engine and everything
after it read only this) -> ``EngineConfig.with_model()`` once the weights are loaded and the KV pool is sized,
which fixes ``max_model_len``. Every config validates itself on construction and raises ``ValueError`` with the
field name; every number derived from the settings (lookahead slots, KV capacity, CUDA-graph rows) is a named
property computed in one place.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from specserve.speculative.config import SpeculativeConfig

log = logging.getLogger("specserve")

ATTENTION_BACKENDS = ("auto", "triton", "sdpa")

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
    it takes what ``max_num_seqs`` sequences of ``max_model_len`` tokens need, at least one such sequence and
    at most ``cpu_kv_cache_bytes`` (default 2 GiB) or an eighth of the memory available when the engine starts
    (``kv_cache.cpu_kv_budget``; measured in docs/BENCHMARKS.md).
    """

    block_size: int = 16
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    cpu_kv_cache_bytes: int = 2 << 30
    num_blocks: int | None = None  # exact block count; overrides the byte budget (tests use tiny pools)
    # automatic prefix caching: full blocks keyed by their tokens (and all before them) are shared between requests
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        _check_int("block_size", self.block_size, 1)
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching must be True or False, got {self.enable_prefix_caching!r}")
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if (not isinstance(self.gpu_memory_utilization, (int, float)) or isinstance(self.gpu_memory_utilization, bool)
                or not 0.0 < self.gpu_memory_utilization <= 1.0):
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        if self.kv_cache_memory_bytes is not None:
            _check_int("kv_cache_memory_bytes", self.kv_cache_memory_bytes, 1)
        if self.num_blocks is not None:  # one block is reserved for padding
            _check_int("num_blocks", self.num_blocks, 2)


@dataclass
class SchedulerConfig:
    """Continuous batching limits.

    ``max_num_batched_tokens`` is the per-step token budget shared by prefill chunks and decodes;
    a prompt longer than the budget is prefilled in chunks (chunked prefill is always on).
    """

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # defaults to the model's max_position_embeddings
    # KV slots reserved beyond a sampling request's tokens (``SpeculativeConfig.lookahead_slots``; 0 without)
    num_lookahead_slots: int = 0
    # D: drafts a request proposes each step (0 without speculation), and the drafts it verifies at most (D, or a
    # draft tree's nodes); the overlap scheduler counts a running request's next drafts before the host has them
    max_draft_len: int = 0
    num_verify_drafts: int = 0
    # only the first request a step admits may start a chunk of its prompt (the engine sets it where steps run in
    # CUDA-graph layouts): the rows of a burst of arrivals then all end their prompts and run as one prefill graph
    whole_prompts_together: bool = False

    def __post_init__(self) -> None:
        _check_int("max_num_seqs", self.max_num_seqs, 1)
        _check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        if self.max_model_len is not None:  # None: the model's length
            _check_int("max_model_len", self.max_model_len, 1)
        _check_int("num_lookahead_slots", self.num_lookahead_slots, 0)
        _check_int("max_draft_len", self.max_draft_len, 0)
        _check_int("num_verify_drafts", self.num_verify_drafts, 0)


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


def _check_int(name: str, value, minimum: int) -> None:
    """An integer setting (not a bool, a float or a string) of at least ``minimum``."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be at least {minimum}, got {value}")


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def blocks_for_bytes(budget: int, bytes_per_block: int) -> int:
    return max(0, math.floor(budget / bytes_per_block))


@dataclass
class EngineArgs:
    """Everything needed to build an engine, as the user gave it: the keyword arguments of ``LLM`` (vLLM's
    names). ``create_engine_config`` validates them into the ``EngineConfig`` the engine reads."""

    model: str | None = None  # HF folder, .gguf file, or None for the embedded default
    dtype: str = "auto"
    device: str | None = None
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9  # of the GPU's total memory, as vLLM
    num_kv_blocks: int | None = None
    enable_prefix_caching: bool = True  # vLLM's name and default
    speculative_config: SpeculativeConfig | dict | None = None
    enforce_eager: bool = False  # True: no CUDA graphs (used on CUDA only); steps keep the graphs' padded layouts
    max_cuda_graph_batch_size: int = 128  # larger decode batches run eagerly
    attention_backend: str = "auto"  # "auto" (Triton kernel on CUDA, prompts from 0 through SDPA), "triton", "sdpa"
    # detokenize and report a step while the device runs the next one (``LLMEngine.step``); None: on CUDA
    async_output: bool | None = None
    # schedule and launch step n + 1 before step n's result reaches the host (``LLMEngine.step``); None: on CUDA
    # with CUDA graphs (``--disable-overlap-scheduler`` turns it off)
    overlap_scheduler: bool | None = None
    # torch intra-op threads on the CPU (process-wide); None: ``default_cpu_threads()``, measured in BENCHMARKS.md
    cpu_threads: int | None = None
    # ranks the model's attention heads and MLP features are split over, one process each (``distributed.py``)
    tensor_parallel_size: int = 1

    def create_engine_config(self) -> "EngineConfig":
        """Validate every setting that does not need the model's weights (a bad value fails here, before a
        model is loaded) -> the engine's one configuration."""
        device = resolve_device(self.device)
        dtype = resolve_dtype(self.dtype, device)
        cache = CacheConfig(block_size=self.block_size, kv_cache_memory_bytes=self.kv_cache_memory_bytes,
                            gpu_memory_utilization=self.gpu_memory_utilization, num_blocks=self.num_kv_blocks,
                            enable_prefix_caching=self.enable_prefix_caching)
        spec = SpeculativeConfig.from_value(self.speculative_config)
        if spec is not None and spec.draft_model is None:
            raise ValueError("speculative decoding needs a draft_model folder (--draft PATH)")
        if self.cpu_threads is not None:
            _check_int("cpu_threads", self.cpu_threads, 1)
        _check_int("tensor_parallel_size", self.tensor_parallel_size, 1)
        if device.type == "cuda" and self.tensor_parallel_size > torch.cuda.device_count():
            raise ValueError(f"tensor_parallel_size={self.tensor_parallel_size} needs as many GPUs; "
                             f"{torch.cuda.device_count()} are visible")
        sched = SchedulerConfig(max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
                                max_model_len=self.max_model_len,
                                num_lookahead_slots=spec.lookahead_slots if spec is not None else 0,
                                max_draft_len=spec.max_draft_len if spec is not None else 0,
                                num_verify_drafts=spec.num_nodes if spec is not None else 0)
        if not isinstance(self.enforce_eager, bool):
            raise ValueError(f"enforce_eager must be True or False, got {self.enforce_eager!r}")
        for name in ("async_output", "overlap_scheduler"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"{name} must be True, False or None, got {value!r}")
        return EngineConfig(model=self.model, device=device, dtype=dtype, cache_config=cache,
                            scheduler_config=sched, speculative_config=spec, attention_backend=self.attention_backend,
                            enforce_eager=self.enforce_eager,
                            async_output=device.type == "cuda" if self.async_output is None else self.async_output,
                            max_cuda_graph_batch_size=self.max_cuda_graph_batch_size,
                            overlap_scheduler=(device.type == "cuda" and self.max_cuda_graph_batch_size > 0
                                               if self.overlap_scheduler is None else self.overlap_scheduler),
                            cpu_threads=(self.cpu_threads or default_cpu_threads()) if device.type == "cpu" else None,
                            tensor_parallel_size=self.tensor_parallel_size)


def default_cpu_threads() -> int | None:
    """torch intra-op threads for a CPU engine on a machine of at most 2 cores: 1. Decoding runs a chain of small
    matmuls and paged-KV gathers per token, too small to split; on this project's 2-core machine under load torch's
    default (2, one per core) decoded the default model 4-16x slower than 1 thread and prefilled 1024 tokens 2-3x
    slower (docs/BENCHMARKS.md, "CPU defaults"). Larger machines were not measured: None keeps torch's default
    (the setting is process-wide, so it is left alone where no measurement backs a change). ``cpu_threads`` /
    ``--cpu-threads`` overrides it."""
    return 1 if (os.cpu_count() or 1) <= 2 else None


@dataclass(frozen=True)
class EngineConfig:
    """The engine's one validated configuration (``EngineArgs.create_engine_config``); ``LLMEngine`` and
    everything it builds read only this. ``model_config`` and ``num_kv_blocks`` are known once the model is
    loaded and the KV pool sized: ``with_model`` adds them and fixes ``max_model_len``."""

    model: str | None  # the model reference, for the loader
    device: torch.device
    dtype: torch.dtype
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    speculative_config: SpeculativeConfig | None = None
    attention_backend: str = "auto"
    enforce_eager: bool = False
    async_output: bool = False  # resolved: True on CUDA unless the user turned it off
    # resolved: True on CUDA with graphs unless turned off; it reports a step one call late, as async_output does
    overlap_scheduler: bool = False
    max_cuda_graph_batch_size: int = 128
    model_config: ModelConfig | None = None  # set by ``with_model``
    num_kv_blocks: int | None = None  # KV pool size in blocks (block 0 is padding), set by ``with_model``
    cpu_threads: int | None = None  # resolved torch intra-op threads (CPU engines; None on CUDA)
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be auto, triton or sdpa, got {self.attention_backend!r}")
        _check_int("max_cuda_graph_batch_size", self.max_cuda_graph_batch_size, 0)

    # -- derived numbers, each computed here only ----------------------------------------------------------------
    @property
    def max_draft_len(self) -> int:
        """D, the configured draft length (0 without speculative decoding)."""
        return self.speculative_config.max_draft_len if self.speculative_config is not None else 0

    @property
    def lookahead_slots(self) -> int:
        """KV slots past a row's tokens that a step may write (the draft loop's, D - 1; 0 without speculation);
        the scheduler reserves them (``scheduler_config.num_lookahead_slots``)."""
        return self.speculative_config.lookahead_slots if self.speculative_config is not None else 0

    @property
    def verify_len(self) -> int:
        """Tokens a decoding row computes per step: 1, or D + 1 with speculation."""
        return self.speculative_config.verify_len if self.speculative_config is not None else 1

    @property
    def kv_slots_past_len(self) -> int:
        """KV slots a sequence of ``max_model_len`` tokens may still write (2 D with speculation, else 0)."""
        return self.speculative_config.kv_slots_past_len if self.speculative_config is not None else 0

    @property
    def cuda_graph_max_rows(self) -> int:
        """Most rows of a step replayed from a CUDA graph; larger decode batches run eagerly."""
        return min(self.scheduler_config.max_num_seqs, self.max_cuda_graph_batch_size)

    @property
    def kv_capacity(self) -> int:
        """Token slots of the KV pool (every block but the padding block 0)."""
        if self.num_kv_blocks is None:
            raise RuntimeError("the KV pool is not sized yet (EngineConfig.with_model)")
        return (self.num_kv_blocks - 1) * self.cache_config.block_size

    @property
    def max_model_len(self) -> int:
        """Longest sequence (prompt + output) the engine runs: the user's, else the model's context, lowered to
        what the KV pool holds (``with_model``)."""
        if self.model_config is None:
            raise RuntimeError("max_model_len is known once the model is loaded (EngineConfig.with_model)")
        return self.scheduler_config.max_model_len

    def with_model(self, model_config: ModelConfig, num_kv_blocks: int) -> "EngineConfig":
        """This config completed by the loaded model's shape and the KV pool's size: ``max_model_len`` is checked
        against the model's context and lowered (with a warning) to what the pool holds besides the slots
        speculation writes past a sequence's end."""
        context = model_config.max_position_embeddings
        asked = self.scheduler_config.max_model_len
        if asked is not None and asked > context:
            raise ValueError(f"max_model_len={asked} exceeds the model's context of {context} "
                             "(max_position_embeddings)")
        max_len = context if asked is None else asked
        _check_int("num_kv_blocks", num_kv_blocks, 2)
        done = dataclasses.replace(self, model_config=model_config, num_kv_blocks=num_kv_blocks)
        capacity = done.kv_capacity - self.kv_slots_past_len
        if capacity < 2:  # a prompt token and one generated token
            raise ValueError(
                f"the KV cache holds {done.kv_capacity} tokens ({num_kv_blocks - 1} blocks of "
                f"{self.cache_config.block_size}), too few for one sequence"
                + (f" with {self.kv_slots_past_len} slots of speculation past its end" if self.kv_slots_past_len
                   else "") + ": give the KV cache more memory or blocks")
        if max_len > capacity:
            log.warning("KV cache holds %d tokens; max_model_len lowered from %d to %d", capacity, max_len, capacity)
            max_len = capacity
        return dataclasses.replace(done, scheduler_config=dataclasses.replace(self.scheduler_config,
                                                                              max_model_len=max_len))
