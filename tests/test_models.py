"""Model correctness against transformers: HF folders (every architecture, sharded checkpoints),
GGUF files (F32 and quantized, with llama.cpp's q/k permutation), auxiliary hidden states, tokenizers
from GGUF metadata, and the loaders' error messages.

All models are tiny random ones written in the real formats by ``tiny_models``; everything runs in
float32 on the CPU and is compared with tight tolerances.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.core.request import Request
from specserve.scheduler.scheduler import ScheduledRequest, SchedulerOutput
from tiny_models import make_hf_model, write_gguf

ATOL = 1e-4
ARCHS = ["llama", "llama3", "qwen2", "qwen3", "mistral"]
GGUF_ARCH = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
PROMPT_LEN = 45  # spans three KV blocks of 16


# --------------------------------------------------------------------------------------------------
# helpers


def load_llm(path) -> LLM:
    # A small explicit pool: the CPU default would allocate 2 GiB of KV cache per engine.
    return LLM(str(path), device="cpu", dtype="float32", num_kv_blocks=16)


def prompt_ids(vocab_size: int, n: int = PROMPT_LEN, seed: int = 1) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (n,), generator=g).tolist()


def specserve_forward(llm: LLM, ids: list[int], chunks: tuple[int, ...] | None = None, aux_layers=()):
    """Prefill ``ids`` through specserve's runner and model (in ``chunks`` of the given sizes, one step
    each). Returns (logits [n_last_chunk, V] of the last step's tokens, aux of the last step)."""
    eng = llm.engine
    chunks = chunks or (len(ids),)
    assert sum(chunks) == len(ids)
    req = Request("x", None, ids, SamplingParams(temperature=0), 500, ())
    eng.pool.reserve(req.block_ids, len(ids))
    try:
        start = 0
        with torch.inference_mode():
            for i, n in enumerate(chunks):
                last = i == len(chunks) - 1
                inp = eng.runner.prepare(SchedulerOutput([ScheduledRequest(req, start, n, last)]))
                h, aux = eng.model(inp.input_ids, inp.positions, inp.meta, eng.runner.kv_views,
                                   aux_layers=aux_layers if last else ())
                start += n
            logits = eng.model.compute_logits(h)
    finally:
        eng.pool.free(req.block_ids)
    return logits, aux


def hf_forward(model, ids: list[int], hidden_states: bool = False):
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_hidden_states=hidden_states)
    return out


def assert_close(actual: torch.Tensor, expected: torch.Tensor, atol: float = ATOL) -> None:
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    diff = (actual.float() - expected.float()).abs().max().item()
    assert diff < atol, f"max abs diff {diff:.3g} >= {atol}"


def cosine_rows(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cosine_similarity(a.float(), b.float(), dim=-1)


class _Cache:
    """Builds each tiny model (and its specserve engine) once per module."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.models: dict[str, tuple[Path, object]] = {}
        self.llms: dict[str, LLM] = {}

    def hf(self, arch: str):
        if arch not in self.models:
            folder = self.root / arch
            self.models[arch] = (folder, make_hf_model(folder, arch, seed=ARCHS.index(arch)))
        return self.models[arch]

    def llm(self, arch: str) -> LLM:
        if arch not in self.llms:
            self.llms[arch] = load_llm(self.hf(arch)[0])
        return self.llms[arch]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return _Cache(tmp_path_factory.mktemp("models"))


# --------------------------------------------------------------------------------------------------
# 1. HF folders: logits equal transformers


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_match_transformers(models, arch):
    folder, hf = models.hf(arch)
    llm = models.llm(arch)
    cfg = llm.engine.model_config
    # the config features each architecture is here to exercise really reached the model
    if arch == "llama3":
        assert cfg.rope_scaling.rope_type == "llama3"
    if arch == "qwen2":
        assert cfg.attention_bias and not cfg.qk_norm
    if arch == "qwen3":
        assert cfg.qk_norm and cfg.tie_word_embeddings and cfg.head_dim == 32 != cfg.hidden_size // 4
        assert llm.engine.model.lm_head is None
    ids = prompt_ids(cfg.vocab_size)
    logits, aux = specserve_forward(llm, ids)
    assert aux == []
    expected = hf_forward(hf, ids).logits[0]
    assert_close(logits, expected)
    assert expected.abs().max() > 1e-2  # the comparison is not between two near-zero tensors


@pytest.mark.parametrize("arch", ARCHS)
def test_chunked_prefill_matches_transformers(models, arch):
    _, hf = models.hf(arch)
    llm = models.llm(arch)
    ids = prompt_ids(llm.engine.model_config.vocab_size, seed=2)
    n = len(ids)
    logits, _ = specserve_forward(llm, ids, chunks=(20, n - 20))
    expected = hf_forward(hf, ids).logits[0]
    assert logits.shape[0] == n - 20
    assert_close(logits[-1], expected[-1])
    assert_close(logits, expected[20:])  # every position of the second chunk


def test_llama_attention_bias_matches_transformers(tmp_path):
    """Llama (and Qwen3) with ``attention_bias: true`` has biases on q, k, v *and* o_proj."""
    folder = tmp_path / "llama_bias"
    hf = make_hf_model(folder, "llama", seed=11, attention_bias=True)
    assert any(n.endswith("o_proj.bias") for n, _ in hf.named_parameters())
    llm = load_llm(folder)
    ids = prompt_ids(llm.engine.model_config.vocab_size)
    logits, _ = specserve_forward(llm, ids)
    assert_close(logits, hf_forward(hf, ids).logits[0])


# --------------------------------------------------------------------------------------------------
# 2. auxiliary hidden states (EAGLE-3 inputs)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_aux_hidden_states_match_transformers(models, arch):
    _, hf = models.hf(arch)
    llm = models.llm(arch)
    ids = prompt_ids(llm.engine.model_config.vocab_size, seed=3)
    logits, aux = specserve_forward(llm, ids, aux_layers=(0, 2))
    out = hf_forward(hf, ids, hidden_states=True)
    # HF's hidden_states[0] is the embedding and [i + 1] the output of layer i (the last one post-norm)
    assert len(aux) == 2
    assert_close(aux[0], out.hidden_states[1][0])
    assert_close(aux[1], out.hidden_states[3][0])
    assert not torch.allclose(aux[0], aux[1])
    assert_close(logits, out.logits[0])  # asking for aux states does not change the logits
    _, none = specserve_forward(llm, ids)
    assert none == []


# --------------------------------------------------------------------------------------------------
# 3. sharded checkpoints


def test_sharded_checkpoint(tmp_path):
    folder = tmp_path / "sharded"
    hf = make_hf_model(folder, "qwen2", seed=5, shards=3)
    shards = sorted(folder.glob("*.safetensors"))
    assert len(shards) > 1
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == len(shards)
    llm = load_llm(folder)
    ids = prompt_ids(llm.engine.model_config.vocab_size)
    logits, _ = specserve_forward(llm, ids)
    assert_close(logits, hf_forward(hf, ids).logits[0])


# --------------------------------------------------------------------------------------------------
# 4. GGUF (F32): same logits as the original model, tokenizer and chat template from the metadata


@pytest.fixture(scope="module")
def gguf_models(models, tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")
    out = {}
    for arch, garch in GGUF_ARCH.items():
        folder, hf = models.hf(arch)
        path = root / f"{arch}.gguf"
        write_gguf(path, folder, hf, arch=garch, qtype="F32")
        out[arch] = (path, load_llm(path))
    return out


@pytest.mark.parametrize("arch", list(GGUF_ARCH))
def test_gguf_logits_match_transformers(models, gguf_models, arch):
    _, hf = models.hf(arch)
    path, llm = gguf_models[arch]
    cfg, ref_cfg = llm.engine.model_config, models.llm(arch).engine.model_config
    for field in ("architecture", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                  "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta",
                  "tie_word_embeddings", "attention_bias", "qk_norm"):
        got, want = getattr(cfg, field), getattr(ref_cfg, field)
        if isinstance(want, float):  # GGUF stores floats as f32
            assert got == pytest.approx(want, rel=1e-6), field
        else:  # pytest >= 9.2 refuses approx on strings
            assert got == want, field
    ids = prompt_ids(cfg.vocab_size)
    logits, _ = specserve_forward(llm, ids)
    assert_close(logits, hf_forward(hf, ids).logits[0])
    # the chunked path reads the same weights through the KV cache
    chunked, _ = specserve_forward(llm, ids, chunks=(20, len(ids) - 20))
    assert_close(chunked, logits[20:])


@pytest.mark.parametrize("arch", list(GGUF_ARCH))
def test_gguf_tokenizer_matches_folder(models, gguf_models, arch):
    from transformers import AutoTokenizer

    folder, _ = models.hf(arch)
    _, llm = gguf_models[arch]
    from tokenizers import Tokenizer as RawTokenizer

    ref = AutoTokenizer.from_pretrained(str(folder))
    raw = RawTokenizer.from_file(str(folder / "tokenizer.json"))  # exactly what the GGUF metadata encodes
    tok = llm.tokenizer
    for text in ["Hello world!", "The quick brown fox jumps over the lazy dog.", "def main(): return 42\n\tx",
                 "<|im_start|>user\nhi<|im_end|>", "unseen wørds ✓ 你好", "  spaces\n\n  and 0123456789"]:
        ids = tok.encode(text)
        assert ids == raw.encode(text).ids, text
        assert tok.decode(ids, skip_special_tokens=False) == text
        # transformers loads a folder whose model_type is qwen2 with Qwen2Tokenizer, which swaps in
        # Qwen2's pre-tokenizer (digits split one by one); tiny_models.write_gguf records the folder's
        # own tokenizer.json pre-tokenizer ('default'), so the two differ on digits for qwen2 only.
        if not (arch == "qwen2" and any(c.isdigit() for c in text)):
            assert ids == list(ref.encode(text)), text
    assert tok.eos_token_id == ref.eos_token_id == ref.convert_tokens_to_ids("<|im_end|>")
    assert llm.engine.model_config.eos_token_ids == (ref.eos_token_id,)
    msgs = [{"role": "user", "content": "hi"}]
    expected = ref.encode(ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True),
                          add_special_tokens=False)
    got = tok.apply_chat_template(msgs)
    assert got == list(expected)
    assert got == models.llm(arch).tokenizer.apply_chat_template(msgs)
    assert tok.decode(got, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_a_second_engine_on_a_gguf_file_reuses_its_tokenizer_until_the_file_changes(tmp_path):
    """transformers' tokenizer of a GGUF file is kept for the next engine of the process (most of an engine's
    start on the default model), each engine with its own copy; a file rewritten in place is read anew."""
    from specserve.tokenizer import _gguf_tokenizer

    folder = tmp_path / "hf"
    hf = make_hf_model(folder, "llama")
    path = tmp_path / "m.gguf"
    write_gguf(path, folder, hf, arch="llama", qtype="F32")
    first = load_llm(path)
    built = _gguf_tokenizer.cache_info().misses
    second = load_llm(path)
    assert _gguf_tokenizer.cache_info().misses == built
    assert second.tokenizer.hf is not first.tokenizer.hf  # a copy each: not shared across threads
    msgs = [{"role": "user", "content": "hi"}]
    assert second.tokenizer.apply_chat_template(msgs) == first.tokenizer.apply_chat_template(msgs)
    # the same path, size and inode, other contents: only the modification time tells (a key without it fails)
    write_gguf(path, folder, hf, arch="llama", qtype="F32")
    load_llm(path)
    assert _gguf_tokenizer.cache_info().misses == built + 1


# --------------------------------------------------------------------------------------------------
# 5. GGUF quantized types
#
def _copy_folder(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_error_unknown_architecture(models, tmp_path):
    folder = _copy_folder(models.hf("llama")[0], tmp_path / "foo")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["architectures"] = ["FooForCausalLM"]
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="FooForCausalLM"):
        load_llm(folder)


def _resave(folder: Path, edit) -> None:
    from safetensors.torch import load_file, save_file

    f = folder / "model.safetensors"
    tensors = load_file(str(f))
    edit(tensors)
    save_file(tensors, str(f), metadata={"format": "pt"})


def test_error_missing_tensor(models, tmp_path):
    folder = _copy_folder(models.hf("llama")[0], tmp_path / "missing")
    name = "model.layers.2.mlp.up_proj.weight"
    _resave(folder, lambda t: t.pop(name))
    with pytest.raises(ValueError, match="missing tensor") as e:
        load_llm(folder)
    assert name in str(e.value)


def test_error_misshaped_tensor(models, tmp_path):
    folder = _copy_folder(models.hf("qwen2")[0], tmp_path / "shape")
    name = "model.layers.1.self_attn.k_proj.bias"

    def edit(t):
        assert tuple(t[name].shape) == (32,)
        t[name] = torch.zeros(31)

    _resave(folder, edit)
    with pytest.raises(ValueError) as e:
        load_llm(folder)
    msg = str(e.value)
    assert name in msg and "(31,)" in msg and "(32,)" in msg


def test_error_sharded_index_names_missing_shard(tmp_path):
    folder = tmp_path / "sharded"
    make_hf_model(folder, "llama", shards=3)
    shard = sorted(folder.glob("*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(ValueError, match=shard.name):
        load_llm(folder)


def test_error_gguf_unknown_architecture(tmp_path):
    import gguf

    path = tmp_path / "gpt2.gguf"
    w = gguf.GGUFWriter(str(path), "gpt2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="'gpt2'.*not supported"):
        load_llm(path)


def test_error_gguf_corrupt_file(tmp_path):
    path = tmp_path / "junk.gguf"
    path.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        load_llm(path)


def test_error_model_path_does_not_exist(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(ValueError, match="not found") as e:
        load_llm(missing)
    assert str(missing) in str(e.value)


def test_error_not_a_gguf_file(tmp_path):
    path = tmp_path / "model.bin"
    path.write_bytes(b"\0" * 16)
    with pytest.raises(ValueError, match=r"not a \.gguf file") as e:
        load_llm(path)
    assert "model.bin" in str(e.value)


def test_error_folder_without_config(models, tmp_path):
    folder = _copy_folder(models.hf("llama")[0], tmp_path / "noconfig")
    (folder / "config.json").unlink()
    with pytest.raises(ValueError, match="config.json") as e:
        load_llm(folder)
    assert str(folder) in str(e.value)
