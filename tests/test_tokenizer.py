"""Tokenizer.decode through the Rust backend equals transformers' decode (it runs for every generated token),
and tokenizers whose transformers decode post-processes text keep transformers' path."""

from __future__ import annotations

import random

from specserve.tokenizer import Tokenizer
from tiny_models import make_hf_model


def test_fast_decode_equals_transformers_decode(tmp_path):
    make_hf_model(tmp_path / "m", "llama", num_hidden_layers=1)
    tok = Tokenizer.from_folder(tmp_path / "m")
    assert tok._decode_fast is not None
    rng = random.Random(0)
    for _ in range(500):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 10))]
        for skip in (True, False):
            assert tok.decode(ids, skip) == tok.hf.decode(ids, skip_special_tokens=skip)


def test_clean_up_spaces_keeps_transformers_decode(tmp_path):
    make_hf_model(tmp_path / "m", "llama", num_hidden_layers=1)
    tok = Tokenizer.from_folder(tmp_path / "m")
    tok.hf.clean_up_tokenization_spaces = True
    assert Tokenizer(tok.hf)._decode_fast is None
    ids = tok.encode("hello , world .")
    assert Tokenizer(tok.hf).decode(ids) == tok.hf.decode(ids, skip_special_tokens=True)


def _chunked_text(tok: Tokenizer, prompt: list[int], ids: list[int], rng: random.Random) -> str:
    """Feed ``ids`` to an IncrementalDetokenizer in random chunks of 1-5 (a speculative step's tokens)."""
    from specserve.tokenizer import IncrementalDetokenizer

    det = IncrementalDetokenizer(tok, prompt)
    text, i = "", 0
    while i < len(ids):
        n = rng.randrange(1, 6)
        text += det.add(ids[i:i + n])
        i += n
    return text + det.flush()


def test_incremental_detokenizer_with_several_tokens_per_step_equals_full_decode(tmp_path):
    """Tokens arrive one at a time or several per step; the text is the same as decoding them at once,
    multi-byte characters split over tokens included (the default model's byte-level BPE)."""
    from specserve.loaders import default_model_path

    make_hf_model(tmp_path / "m", "llama", num_hidden_layers=1)
    toks = [Tokenizer.from_folder(tmp_path / "m"), Tokenizer.from_gguf(default_model_path())]
    texts = ["Hello world, this is plain text.", "naïve café — 東京 🙂 ok", "def f(x):\n    return x * 2\n"]
    rng = random.Random(1)
    for tok in toks:
        for t in texts:
            ids = tok.encode(t)
            prompt = tok.encode("Q: ")
            assert _chunked_text(tok, prompt, ids, rng) == tok.decode(ids), (t, ids)
