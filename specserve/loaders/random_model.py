"""Random-weight models with the shapes of known checkpoints (``random:NAME``), built directly on the device.

Used to measure the engine where decoding is bandwidth-bound (Llama-3.1-8B shapes) without a checkpoint;
timings do not depend on the weights. The tokenizer is a word-level vocabulary ``t0 .. t{V-1}``, enough to
run prompts of random token ids end to end.
"""

from __future__ import annotations

import torch

from specserve.config import ModelConfig, RopeScaling

SCALE_MODELS = {
    # meta-llama/Llama-3.1-8B-Instruct config.json (public facts: shapes and RoPE scaling)
    "llama-3.1-8b": dict(
        architecture="LlamaForCausalLM", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5,
        rope_theta=500000.0, max_position_embeddings=131072, tie_word_embeddings=False,
        rope_scaling=RopeScaling(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                 original_max_position_embeddings=8192),
        bos_token_id=128000, eos_token_ids=(128009,)),
    # HuggingFaceTB/SmolLM2-135M-Instruct shapes
    "smollm2-135m": dict(
        architecture="LlamaForCausalLM", vocab_size=49152, hidden_size=576, intermediate_size=1536,
        num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5,
        rope_theta=100000.0, max_position_embeddings=8192, tie_word_embeddings=True, eos_token_ids=(2,)),
}


def is_random_ref(model) -> bool:
    return isinstance(model, str) and model.startswith("random:")


def random_config(model: str) -> ModelConfig:
    name = model.split(":", 1)[1]
    if name not in SCALE_MODELS:
        raise ValueError(f"unknown random model {name!r}; known: {sorted(SCALE_MODELS)}")
    return ModelConfig(**SCALE_MODELS[name])


def word_tokenizer(vocab_size: int, eos_token_id: int):
    """A word-level tokenizer over ``t0 .. t{V-1}`` (whitespace-separated), as a transformers fast tokenizer."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from tokenizers.decoders import WordPiece
    from transformers import PreTrainedTokenizerFast

    raw = RawTokenizer(WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    raw.pre_tokenizer = WhitespaceSplit()
    raw.decoder = WordPiece(prefix="##", cleanup=False)
    return PreTrainedTokenizerFast(tokenizer_object=raw, eos_token=f"t{eos_token_id}", unk_token="t0")


def init_random_(module: torch.nn.Module, seed: int = 0, std: float = 0.02) -> None:
    """Normal(0, std) matrices, norms near 1, on the module's device (no host copy of the weights)."""
    g = torch.Generator(device=next(module.parameters()).device).manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.dim() == 1:
                p.fill_(1.0) if "norm" in name else p.zero_()
            else:
                p.normal_(0.0, std, generator=g)
