"""Tokenizer.decode through the Rust backend equals transformers' decode (it runs for every generated token),
with transformers' space clean-up where the tokenizer asks for it."""

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


def test_clean_up_spaces_decode_equals_transformers_decode(tmp_path, monkeypatch):
    """A transformers decode that cleans up spaces (" ," -> ",": GGUF tokenizers in some transformers
    versions) is matched on the fast path; one that post-processes otherwise keeps transformers' decode."""
    make_hf_model(tmp_path / "m", "llama", num_hidden_layers=1)
    hf = Tokenizer.from_folder(tmp_path / "m").hf
    backend_decode = hf.backend_tokenizer.decode

    def cleaning_decode(ids, skip_special_tokens=False, **kw):
        return hf.clean_up_tokenization(backend_decode(list(ids), skip_special_tokens=skip_special_tokens))

    monkeypatch.setattr(hf, "decode", cleaning_decode)
    fast = Tokenizer(hf)
    assert fast._decode_fast is not None and fast._clean_up is not None
    ids = hf.encode("hello , world . it 's n't", add_special_tokens=False)
    assert "," in fast.decode(ids) and " ," not in fast.decode(ids)
    rng = random.Random(1)
    for _ in range(300):
        ids = [rng.randrange(fast.vocab_size) for _ in range(rng.randrange(1, 10))]
        for skip in (True, False):
            assert fast.decode(ids, skip) == cleaning_decode(ids, skip_special_tokens=skip)
    monkeypatch.setattr(hf, "decode", lambda ids, skip_special_tokens=False, **kw: "<" + backend_decode(list(ids)))
    other = Tokenizer(hf)
    assert other._decode_fast is None and other.decode([5, 6]) == "<" + backend_decode([5, 6])


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
