"""Tokenizer, chat template and incremental detokenization (on top of Hugging Face tokenizers)."""

from __future__ import annotations

import copy
import functools
from pathlib import Path
from typing import Sequence


class Tokenizer:
    """Wraps a Hugging Face fast tokenizer loaded from a model folder or from GGUF metadata."""

    def __init__(self, hf_tokenizer) -> None:
        self.hf = hf_tokenizer
        self.eos_token_id: int | None = hf_tokenizer.eos_token_id
        self.vocab_size = len(hf_tokenizer)
        # the Rust tokenizer behind a fast tokenizer decodes without transformers' per-call Python overhead
        # (detokenization runs twice per row and step)
        self._decode_fast, self._clean_up = _fast_decode(hf_tokenizer)

    @classmethod
    def from_folder(cls, folder: Path) -> "Tokenizer":
        from transformers import AutoTokenizer

        if not any((folder / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "vocab.json")):
            raise ValueError(f"{folder}: no tokenizer files (tokenizer.json or tokenizer.model)")
        return cls(AutoTokenizer.from_pretrained(str(folder), local_files_only=True))

    @classmethod
    def from_gguf(cls, path: Path) -> "Tokenizer":
        """Builds the tokenizer (vocabulary, merges, special tokens, chat template) from GGUF metadata."""
        try:
            st = path.stat()  # the file's identity: one rewritten or replaced is read again
            return cls(copy.deepcopy(_gguf_tokenizer(str(path.resolve()), st.st_size, st.st_ino, st.st_mtime_ns)))
        except Exception as e:
            raise ValueError(f"{path}: cannot build a tokenizer from the GGUF metadata ({e})") from None

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def encode(self, text: str) -> list[int]:
        return list(self.hf.encode(text))

    def apply_chat_template(self, messages: Sequence[dict], add_generation_prompt: bool = True) -> list[int]:
        """``messages``: ``{"role", "content"}`` dicts, a content being a string, None (empty) or a list of
        OpenAI content parts of which only text parts are taken (joined by newlines, as vLLM does)."""
        if not self.has_chat_template:
            raise ValueError("this model's tokenizer has no chat template; use generate() with plain prompts")
        ids = self.hf.apply_chat_template(
            [chat_message(m) for m in messages], add_generation_prompt=add_generation_prompt, tokenize=True,
            return_dict=False
        )
        return list(ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        if self._decode_fast is not None:
            text = self._decode_fast(list(ids), skip_special_tokens=skip_special_tokens)
            return text if self._clean_up is None else self._clean_up(text)
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)


@functools.lru_cache(maxsize=2)
def _gguf_tokenizer(path: str, size: int, inode: int, mtime_ns: int):
    """transformers' tokenizer of a GGUF file, kept for the next engine of this process (keyed by the file's
    identity): building it parses the file's metadata and converts its vocabulary (the default model: about 9 of
    an engine's 13 s of start on the CPU), and a benchmark or a test builds several engines on one file. Each
    engine gets a copy (0.2 s): a fast tokenizer is not safe to call from several threads at once."""
    import logging

    from transformers import AutoTokenizer

    logging.getLogger("transformers").setLevel(logging.ERROR)
    return AutoTokenizer.from_pretrained(str(Path(path).parent), gguf_file=Path(path).name, local_files_only=True)


def chat_message(m) -> dict:
    """One chat message as the template takes it: ``{"role": str, "content": str}``; ValueError otherwise."""
    if not isinstance(m, dict) or not isinstance(m.get("role"), str) or "content" not in m:
        raise ValueError(f"a chat message must be a {{'role', 'content'}} object, got {m!r}")
    content = m["content"]
    if content is None:
        content = ""
    elif isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"only text content parts ({{'type': 'text', 'text': ...}}) are supported, "
                                 f"got {part!r}")
            texts.append(part["text"])
        content = "\n".join(texts)
    elif not isinstance(content, str):
        raise ValueError(f"a message's content must be a string, a list of text parts or null, got {content!r}")
    return {"role": m["role"], "content": content}


_PROBE = "a , b . c 's d n't e ! f ? g 'm h 've i 're"


def _fast_decode(hf_tokenizer):
    """-> (the Rust backend's decode, the space clean-up transformers applies after it, or None), or
    (None, None) where transformers' decode does something else. Which clean-up a fast tokenizer's decode
    applies depends on the transformers version and the tokenizer's settings (GGUF tokenizers ask for it in
    some versions), so it is found by decoding a probe both ways."""
    backend = getattr(hf_tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None, None
    ids = list(hf_tokenizer.encode(_PROBE, add_special_tokens=False))
    want = hf_tokenizer.decode(ids, skip_special_tokens=True)
    raw = backend.decode(ids, skip_special_tokens=True)
    if want == raw:
        return backend.decode, None
    clean = getattr(hf_tokenizer, "clean_up_tokenization", None)
    if clean is not None and want == clean(raw):
        return backend.decode, clean
    return None, None


class IncrementalDetokenizer:
    """Turns a growing token list into text deltas.

    Tokens are decoded in a short sliding window (``prefix`` .. end) and only the text beyond what the
    window's prefix decoded to is new; text ending in an incomplete UTF-8 sequence (U+FFFD) is held
    back until the next token completes it. Cost per token is constant, not quadratic.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int], skip_special_tokens: bool = True) -> None:
        self.tok = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = list(prompt_ids[-4:])  # a little prompt context for leading spaces
        self.prefix = 0
        self.read = len(self.ids)
        self.text = ""
        self._context = len(self.ids)

    @property
    def added(self) -> int:
        """Tokens added so far (the reply's tokens decoded)."""
        return len(self.ids) - self._context

    def add(self, new_ids: Sequence[int]) -> str:
        """Append tokens (one, or a speculative step's several: two decodes either way); returns the newly
        completed text."""
        if not new_ids:
            return ""
        self.ids.extend(new_ids)
        prefix_text = self.tok.decode(self.ids[self.prefix:self.read], self.skip)
        full = self.tok.decode(self.ids[self.prefix:], self.skip)
        if len(full) <= len(prefix_text) or full.endswith("\ufffd"):
            return ""
        delta = full[len(prefix_text):]
        self.prefix, self.read = self.read, len(self.ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """At the end of generation: release held-back text, but not an incomplete UTF-8 sequence at its very end
        (a reply cut by max_tokens mid-character would end in U+FFFD, which is not text the model wrote)."""
        full = self.tok.decode(self.ids[self.prefix:], self.skip)
        prefix_text = self.tok.decode(self.ids[self.prefix:self.read], self.skip)
        piece = full[len(prefix_text):].rstrip("\ufffd")
        self.prefix = self.read = len(self.ids)
        self.text += piece
        return piece
