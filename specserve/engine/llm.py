"""The offline API, in vLLM's shape: ``LLM(model=...).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from specserve.core.request import CompletionOutput, RequestOutput
from specserve.config import EngineArgs
from specserve.engine.llm_engine import LLMEngine
from specserve.sampling_params import RequestOutputKind, SamplingParams

Prompt = str | list[int] | dict


class LLM:
    """An engine for offline batched generation.

    ``model`` is a Hugging Face folder, a ``.gguf`` file, or None for the embedded default
    (SmolLM2-135M-Instruct). Other keyword arguments are the fields of :class:`EngineArgs`; the engine
    validates them into its ``EngineConfig`` (``llm.engine.config``).
    """

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        names = {f.name for f in dataclasses.fields(EngineArgs)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(f"LLM() got unknown arguments {unknown}; known: {sorted(names - {'model'})}")
        self.engine = LLMEngine(EngineArgs(model=model, **kwargs))

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> "LLM":
        """An LLM over an engine built from ``args`` (the command line builds its ``EngineArgs`` itself)."""
        llm = cls.__new__(cls)
        llm.engine = LLMEngine(args)
        return llm

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        raise_on_error: bool = True,
    ) -> list[RequestOutput]:
        """Generate for one or many prompts (text, token ids, or ``{"prompt_token_ids": [...]}``).

        All requests run together under continuous batching; results come back in prompt order. With
        ``use_tqdm`` (the default, as vLLM's) several prompts show a progress bar on stderr; False turns it off.
        With ``raise_on_error=False`` a bad prompt yields an output with ``finish_reason='error'`` and
        ``error`` set while the others run; by default the ``ValueError`` is raised before anything runs.
        """
        plist = _as_prompt_list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(plist)
        else:
            params = list(sampling_params)
            if len(params) != len(plist):
                raise ValueError(f"got {len(params)} SamplingParams for {len(plist)} prompts")
        # only final outputs are returned, so the engine reports each request once, when it ends (vLLM does so too)
        params = _final_only(params)
        ids: list[str | None] = []
        errors: dict[int, str] = {}
        for i, (p, sp) in enumerate(zip(plist, params)):
            try:
                ids.append(self.engine.add_request(_prompt_value(p), sp))
            except ValueError as e:
                if raise_on_error:
                    for rid in ids:
                        if rid is not None:
                            self.engine.abort_request(rid)
                    raise ValueError(f"prompt {i}: {e}") from None
                ids.append(None)
                errors[i] = str(e)
        results: dict[str, RequestOutput] = {}
        bar = _progress(len(ids) - len(errors), use_tqdm)
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        results[out.request_id] = out
                        bar.update(1)
        except BaseException:  # a failed step (or Ctrl-C) must not leave this call's requests in the engine
            for rid in ids:
                if rid is not None and rid not in results:
                    self.engine.abort_request(rid)
            raise
        finally:
            bar.close()
        final = []
        for i, rid in enumerate(ids):
            if rid is None:
                p = plist[i]
                final.append(RequestOutput(str(i), p if isinstance(p, str) else None, [],
                                           [CompletionOutput(0, "", [], "error")], True, error=errors[i]))
            else:
                final.append(results[rid])
        return final

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        raise_on_error: bool = True,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation (a list of ``{"role", "content"}``) or
        to several, and generate the assistant replies."""
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = []
        for conv in convs:  # each message checked there (tokenizer.chat_message): text content parts are joined
            prompts.append({"prompt_token_ids": self.tokenizer.apply_chat_template(conv)})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, raise_on_error=raise_on_error)


def _final_only(params: list) -> list:
    """The requests' sampling parameters with ``output_kind`` FINAL_ONLY (one copy per distinct object; anything
    else is left for ``add_request`` to refuse)."""
    copies: dict[int, Any] = {}
    for sp in params:
        if id(sp) not in copies:
            copies[id(sp)] = (dataclasses.replace(sp, output_kind=RequestOutputKind.FINAL_ONLY)
                              if isinstance(sp, SamplingParams) else sp)
    return [copies[id(sp)] for sp in params]


def _as_prompt_list(prompts) -> list:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(x, int) for x in prompts):
        return [prompts]  # one tokenized prompt
    return prompts


def _prompt_value(p: Prompt):
    if isinstance(p, dict):
        if "prompt_token_ids" in p:
            return list(p["prompt_token_ids"])
        if "prompt" in p:
            return p["prompt"]
        raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
    if isinstance(p, str):
        return p
    if isinstance(p, (list, tuple)):
        return list(p)
    raise ValueError(f"a prompt must be text, a list of token ids or a dict, got {type(p).__name__}")


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def _progress(total: int, enabled: bool):
    if not enabled or total < 2:  # one request: nothing to count
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, desc="generating", unit="req")
