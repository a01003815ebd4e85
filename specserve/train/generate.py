"""Training data written by the target itself: responses to prompts, and prompts it writes as a user.

``regenerate`` answers prompts (chat template), so the head learns the target's own distribution.
``synthesize_prompts`` asks the target for user turns: it is given the chat template up to the start of a
user message and samples the message (the "pre-query template" idea of Magpie, Xu et al. 2024), which gives
prompts in the domains the target was tuned on when the prompt files cover only a few. Optional openers
(``synthetic_openers``: "Classify", "Rewrite", ...) start message i with opener i mod n, so the target writes
requests of those kinds (task instructions with their input) instead of only the kind it writes most often.

Both run through specserve's engine, sharded over ``gen_workers`` processes sharing the device (the engine's
step is host-bound for a small target, so processes add throughput). Request i is always sampled with seed
``base + i``, so the result does not depend on the number of workers.
"""

from __future__ import annotations

import logging

import torch

from specserve.train.config import TrainConfig

log = logging.getLogger("specserve")

RESPOND, ASK = "respond", "ask"


def regenerate(cfg: "TrainConfig", prompts: list) -> list[dict]:
    """Responses of the target to ``prompts`` (user messages, or conversations: lists of messages ending with the
    user's) -> [{"prompt_ids", "response_ids"}] (failed or empty ones dropped)."""
    return [d for d in _sharded(cfg, prompts, RESPOND) if d is not None]


def synthesize_prompts(cfg: "TrainConfig", exclude: set[str]) -> list[str]:
    """``cfg.synthetic_prompts`` user messages written by the target (temperature ``synthetic_temperature``).

    Kept: messages the target ended itself (end-of-turn within ``synthetic_max_tokens``), non-empty, each once,
    and none of ``exclude`` (held-out and evaluation prompts, compared after stripping whitespace).
    """
    openers = cfg.synthetic_openers or [""]
    texts = _sharded(cfg, [openers[i % len(openers)] for i in range(cfg.synthetic_prompts)], ASK)
    seen = {p.strip() for p in exclude}
    kept = []
    for t in texts:
        if t and t not in seen:
            seen.add(t)
            kept.append(t)
    log.info("synthesized %d prompts (%d asked; unfinished, empty, repeated or held-out ones dropped)",
             len(kept), cfg.synthetic_prompts)
    return kept


def pre_query_ids(tokenizer) -> list[int]:
    """Token ids of the chat template up to where a user message's text begins (system turn included)."""
    return _user_turn(tokenizer)[0]


def end_of_turn_ids(tokenizer) -> list[int]:
    """The special token that closes a user message in the template ([] when it is not one token): it ends a
    synthesized message even when the model's end-of-sequence token is another one."""
    return _user_turn(tokenizer)[1]


def _user_turn(tokenizer) -> tuple[list[int], list[int]]:
    if not tokenizer.has_chat_template:
        raise ValueError("--synthetic-prompts needs a target with a chat template")
    a = tokenizer.apply_chat_template([{"role": "user", "content": "a"}])
    b = tokenizer.apply_chat_template([{"role": "user", "content": "Z"}])
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    end = a[n + 1:n + 2]  # the token after the one-token content
    special = end and tokenizer.decode(end, skip_special_tokens=True) == "" and \
        tokenizer.decode(end, skip_special_tokens=False) != ""
    return a[:n], (end if special else [])


def _sharded(cfg: "TrainConfig", items: list[str], kind: str) -> list:
    indexed = list(enumerate(items))
    n = min(cfg.gen_workers, max(1, len(items)))
    if n == 1:
        rows = _shard(cfg, indexed, 0, 1, kind)
    else:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(n, mp_context=multiprocessing.get_context("spawn")) as pool:
            futures = [pool.submit(_shard, cfg, indexed[w::n], w, n, kind) for w in range(n)]
            rows = [r for f in futures for r in f.result()]
    rows.sort(key=lambda r: r[0])
    return [d for _, d in rows]


def _shard(cfg: "TrainConfig", indexed: list[tuple[int, str]], worker: int, workers: int,
           kind: str) -> list[tuple[int, object]]:
    from specserve import LLM, SamplingParams

    try:  # the workers share one GPU: each may use 1/n of 80% of it, as n vLLM engines would be told
        llm = LLM(cfg.target, dtype=cfg.gen_dtype, device=cfg.device, max_num_seqs=512, max_num_batched_tokens=8192,
                  gpu_memory_utilization=0.8 / workers)
    except ValueError as e:
        if workers == 1:
            raise
        raise ValueError(f"{e} (train-draft: each of the {workers} --gen-workers engines may use "
                         f"{0.8 / workers:.3f} of the GPU; use fewer workers)") from None
    tok = llm.tokenizer
    seed = cfg.seed if cfg.gen_seed is None else cfg.gen_seed
    stop: list[int] = []
    if kind == RESPOND:
        reqs = [{"prompt_token_ids": tok.apply_chat_template([{"role": "user", "content": p}] if isinstance(p, str)
                                                             else p)} for _, p in indexed]
        temperature, max_tokens = cfg.gen_temperature, cfg.gen_max_tokens
    else:
        pre = pre_query_ids(tok)  # + the opener's tokens: the message continues it
        reqs = [{"prompt_token_ids": pre + (tok.hf.encode(o, add_special_tokens=False) if o else [])}
                for _, o in indexed]
        temperature, max_tokens, stop = cfg.synthetic_temperature, cfg.synthetic_max_tokens, end_of_turn_ids(tok)
    params = [SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed + i, stop_token_ids=stop)
              for i, _ in indexed]
    outs = llm.generate(reqs, params, use_tqdm=worker == 0, raise_on_error=False)
    if kind == RESPOND:
        rows = [(i, {"prompt_ids": o.prompt_token_ids, "response_ids": o.token_ids}
                 if o.error is None and o.token_ids else None) for (i, _), o in zip(indexed, outs)]
    else:
        # kept: messages the target ended itself with some text of its own after the opener
        rows = [(i, (op + o.text).strip() if o.error is None and o.finish_reason == "stop" and o.text.strip()
                 else None) for (i, op), o in zip(indexed, outs)]
    del llm
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return rows
