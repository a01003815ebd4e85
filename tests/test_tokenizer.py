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
