"""Tiny random models in real formats (HF folder with tokenizer; GGUF via gguf's writer) for tests."""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# prompts of varied lengths for engine tests on the tiny models
PROMPTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog. Speculative decoding drafts tokens",
    "def main(): return 42",
    "Paged attention keeps keys and values in blocks. Hello world! 0123456789 and more text here",
    "fox",
    "tabs\tand newlines\n and code",
    "The target verifies them. The quick brown fox",
    "0123456789 0123456789 0123456789",
]
CORPUS = (
    "The quick brown fox jumps over the lazy dog. Speculative decoding drafts tokens and the target "
    "verifies them. Paged attention keeps keys and values in blocks. Hello world! 0123456789 "
    "def main(): return 42 # code and text, tabs\tand newlines\n"
) * 20


@lru_cache(maxsize=1)
def _tokenizer_object(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([CORPUS], trainer=trainer)
    return tok


def save_tokenizer(folder: Path, vocab_size: int = 320) -> int:
    """Write tokenizer.json + tokenizer_config.json (with a chat template); returns the real vocab size."""
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_object=_tokenizer_object(vocab_size), eos_token="<|im_end|>",
                                 bos_token="<|im_start|>", pad_token="<|endoftext|>", unk_token="<|endoftext|>")
    hf.chat_template = CHAT_TEMPLATE
    hf.save_pretrained(str(folder))
    return len(hf)


def hf_config(arch: str = "llama", vocab_size: int = 320, **over) -> dict:
    base = dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=512, rms_norm_eps=1e-5, vocab_size=vocab_size, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, torch_dtype="float32",
    )
    if arch == "llama":
        base.update(architectures=["LlamaForCausalLM"], model_type="llama", rope_theta=10000.0)
    elif arch == "llama3":
        base.update(architectures=["LlamaForCausalLM"], model_type="llama", rope_theta=500000.0,
                    rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                      original_max_position_embeddings=64))
    elif arch == "qwen2":
        base.update(architectures=["Qwen2ForCausalLM"], model_type="qwen2", rope_theta=1000000.0)
    elif arch == "qwen3":
        base.update(architectures=["Qwen3ForCausalLM"], model_type="qwen3", rope_theta=1000000.0, head_dim=32,
                    tie_word_embeddings=True)
    elif arch == "mistral":
        base.update(architectures=["MistralForCausalLM"], model_type="mistral", rope_theta=10000.0,
                    sliding_window=None)
    else:
        raise ValueError(arch)
    base.update(over)
    return base


def make_hf_model(folder: Path, arch: str = "llama", seed: int = 0, shards: int = 1, **over):
    """Save a random transformers model + tokenizer as an HF folder; returns the transformers model."""
    from transformers import AutoConfig, AutoModelForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    vocab = over.pop("vocab_size", None) or save_tokenizer(folder)
    if not (folder / "tokenizer.json").is_file():
        save_tokenizer(folder)
    cfg_dict = hf_config(arch, vocab_size=vocab, **over)
    (folder / "config.json").write_text(json.dumps(cfg_dict))
    cfg = AutoConfig.from_pretrained(str(folder))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # HF inits norms to 1 and biases to 0; randomise so tests see them
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    model.eval()
    size = None if shards == 1 else f"{max(1, sum(p.numel() * 4 for p in model.parameters()) // shards // 1000)}KB"
    kwargs = {"max_shard_size": size} if size else {}
    model.save_pretrained(str(folder), safe_serialization=True, **kwargs)
    (folder / "config.json").write_text(json.dumps(cfg_dict))
    return model


def write_gguf(path: Path, hf_folder: Path, model, arch: str = "llama", qtype: str = "F32") -> None:
    """Write ``model`` (a transformers Llama/Qwen) as GGUF with gguf's writer, the way llama.cpp's
    converter does: q/k rows permuted for llama, tokenizer and chat template in the metadata."""
    import gguf
    from gguf.quants import quantize
    from transformers import AutoTokenizer

    from specserve.loaders.gguf_loader import llama_cpp_permute

    cfg = model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    rope = getattr(cfg, "rope_parameters", None) or {}
    w.add_rope_freq_base(float(rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))))
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_vocab_size(cfg.vocab_size)
    tok = AutoTokenizer.from_pretrained(str(hf_folder))
    vocab = tok.get_vocab()
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
    merges = json.loads(tok.backend_tokenizer.to_str())["model"]["merges"]
    w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in merges])
    w.add_bos_token_id(tok.bos_token_id)
    w.add_eos_token_id(tok.eos_token_id)
    w.add_chat_template(CHAT_TEMPLATE)
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    layer = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
             "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
             "self_attn.v_proj.weight": "attn_v.weight", "self_attn.q_proj.bias": "attn_q.bias",
             "self_attn.k_proj.bias": "attn_k.bias", "self_attn.v_proj.bias": "attn_v.bias",
             "self_attn.o_proj.weight": "attn_output.weight", "self_attn.q_norm.weight": "attn_q_norm.weight",
             "self_attn.k_norm.weight": "attn_k_norm.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
             "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight"}
    tied = cfg.tie_word_embeddings
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and tied:
            continue
        if name in names:
            gname = names[name]
        else:
            parts = name.split(".")
            gname = f"blk.{parts[2]}." + layer[".".join(parts[3:])]
        arr = t.detach().float().numpy()
        if arch == "llama" and gname.endswith(("attn_q.weight", "attn_q.bias")):
            arr = llama_cpp_permute(arr, cfg.num_attention_heads)
        elif arch == "llama" and gname.endswith(("attn_k.weight", "attn_k.bias")):
            arr = llama_cpp_permute(arr, cfg.num_key_value_heads)
        qt = getattr(gguf.GGMLQuantizationType, qtype)
        if arr.ndim == 2 and qtype != "F32":
            w.add_tensor(gname, quantize(arr, qt), raw_dtype=qt)
        else:
            w.add_tensor(gname, np.ascontiguousarray(arr))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def make_head(folder: Path, target_folder: Path, method: str = "eagle3", num_modules: int = 1,
              draft_vocab: int | None = None, own_head: bool = True, seed: int = 0) -> Path:
    """Write a random draft head for the HF model in ``target_folder`` with specserve's writers."""
    from specserve.loaders.hf import load_hf_config
    from specserve.speculative.checkpoint import save_eagle3_head, save_mtp_head
    from specserve.speculative.random_heads import random_head

    cfg = load_hf_config(target_folder)
    head = random_head(cfg, method, draft_vocab, num_modules, own_head, seed)
    (save_eagle3_head if method == "eagle3" else save_mtp_head)(head, folder)
    return folder


def make_train_dirs(root: Path) -> Path:
    """The training tests' target (8 layers, large weights so that its outputs vary) and its random EAGLE-3 (on
    the target's lm_head) and MTP heads, under ``root``."""
    make_hf_model(root / "target", "llama", initializer_range=0.4, num_hidden_layers=8)
    make_head(root / "eagle3", root / "target", "eagle3", seed=1, own_head=False)
    make_head(root / "mtp", root / "target", "mtp", num_modules=1, seed=2)
    return root


def target_with_heads(root: Path, num_hidden_layers: int = 2, mtp_modules: int = 1) -> Path:
    """A tiny Llama target in ``root/target``, an EAGLE-3 head over its lm_head in ``root/eagle3`` and an MTP head
    in ``root/mtp``."""
    make_hf_model(root / "target", "llama", initializer_range=0.4, num_hidden_layers=num_hidden_layers)
    make_head(root / "eagle3", root / "target", "eagle3", own_head=False, seed=1)
    make_head(root / "mtp", root / "target", "mtp", num_modules=mtp_modules, seed=2)
    return root


def target_with_eagle3(root: Path, num_hidden_layers: int = 2) -> Path:
    """A tiny Llama target in ``root/target`` and an EAGLE-3 head over its lm_head in ``root/eagle3``."""
    make_hf_model(root / "target", "llama", initializer_range=0.4, num_hidden_layers=num_hidden_layers)
    make_head(root / "eagle3", root / "target", "eagle3", own_head=False, seed=1)
    return root


def abort_while_running(eng, params, steps: int) -> tuple[str, list[str], object]:
    """Two requests (a long one on PROMPTS[3], one with ``params`` on PROMPTS[0]); after ``steps`` engine steps,
    with a step of both in flight, the long one is aborted and the engine run to the end -> (the aborted id, the
    ids reported after the abort, the other request's final output)."""
    from specserve import SamplingParams

    gone = eng.add_request(PROMPTS[3], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    eng.add_request(PROMPTS[0], params)
    for _ in range(steps):
        eng.step()
    assert eng._in_flight is not None and any(s.request.request_id == gone for s in eng._in_flight.batch.scheduled)
    eng.abort_request(gone)
    seen, final = [], None
    while eng.has_unfinished_requests():
        for out in eng.step():
            seen.append(out.request_id)
            final = out if out.finished else final
    return gone, seen, final



def make_target_and_eagle3(root: Path) -> Path:
    """The engine tests' usual pair under ``root``: a 2-layer Llama ``target`` whose random weights make greedy
    choices clear-cut (initializer_range 0.4) and an EAGLE-3 head ``eagle3`` sharing its output layer -> root."""
    make_hf_model(root / "target", "llama", initializer_range=0.4, num_hidden_layers=2)
    make_head(root / "eagle3", root / "target", "eagle3", own_head=False, seed=1)
    return root
