"""``specserve bench --compare hf hf-compile``: transformers ``generate`` on the same prompts, as the baseline."""

from __future__ import annotations

import logging
import statistics
import time

import torch

from specserve.bench.run import BenchConfig, _progress, _sync

log = logging.getLogger("specserve")


def bench_hf(cfg: BenchConfig, prompt_ids: list[list[int]], compiled: bool, eos: tuple[int, ...]) -> list[dict]:
    """transformers ``generate`` (greedy, same prompts, same stopping: ``max_tokens``, and the end-of-sequence
    tokens ``eos`` unless ``ignore_eos``); ``compiled``: a static KV cache,
    with which ``generate`` compiles the decoding forward itself (transformers' automatic compilation of a
    compileable cache; its own ``compile_config`` defaults)."""
    from transformers import AutoModelForCausalLM

    from specserve.config import resolve_device, resolve_dtype
    from specserve.loaders import resolve_model_path

    dev = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, dev)
    path = resolve_model_path(cfg.model)
    if path.is_file():
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    model = model.to(dev).eval()
    name = "transformers+compile" if compiled else "transformers"
    bar = _progress(name, len(cfg.batch_sizes) * (cfg.repeats + 1))
    if compiled:
        model.generation_config.cache_implementation = "static"
    rows = []
    for b in cfg.batch_sizes:
        reqs = [prompt_ids[i % len(prompt_ids)] for i in range(max(b, len(prompt_ids)))]
        chunks = [left_padded(reqs[i:i + b], dev) for i in range(0, len(reqs), b)]

        def run(parts, gen=model.generate):
            outs = []
            for inp, mask in parts:
                with torch.no_grad():
                    outs.append(gen(input_ids=inp, attention_mask=mask, max_new_tokens=cfg.max_tokens,
                                    min_new_tokens=cfg.max_tokens if cfg.ignore_eos else None,
                                    eos_token_id=list(eos), do_sample=False, pad_token_id=0))
            return outs

        bar.set_postfix_str(f"batch {b} warm-up")
        run(chunks[:1])  # warm-up (compilation for the static-cache variant)
        bar.update()
        times, outs = [], None
        for r in range(cfg.repeats):
            bar.set_postfix_str(f"batch {b} run {r + 1}/{cfg.repeats}")
            _sync(dev)
            t0 = time.perf_counter()
            outs = run(chunks)
            _sync(dev)
            times.append(time.perf_counter() - t0)
            bar.update()
        med = statistics.median_low(times)  # as specserve rows report: of an even number the faster middle run
        n_tok = sum(generated_count(o[:, inp.shape[1]:], () if cfg.ignore_eos else eos)
                    for o, (inp, _) in zip(outs, chunks))
        width = chunks[0][0].shape[1]
        rows.append(dict(engine=name, speculative=False, batch=b, requests=len(reqs),
                         new_tokens=round(n_tok / len(reqs), 1), seconds=med, all_seconds=times,
                         tokens_per_s=n_tok / med, first_tokens=outs[0][0, width:width + 16].tolist()))
        log.info("%s batch=%d: %.1f tok/s", name, b, rows[-1]["tokens_per_s"])
    bar.close()
    del model
    return rows


def generated_count(new: torch.Tensor, eos: tuple[int, ...]) -> int:
    """new [B, N]: tokens generate() appended -> tokens generated per row up to and including its first
    end-of-sequence token (a finished row is padded while the others go on), summed."""
    if not eos or new.shape[1] == 0:
        return new.numel()
    hit = torch.isin(new, torch.tensor(list(eos), device=new.device))  # [B, N]
    first = torch.where(hit.any(1), hit.int().argmax(1) + 1, torch.full_like(hit[:, 0], new.shape[1], dtype=torch.long))
    return int(first.sum())


def left_padded(ids: list[list[int]], dev) -> tuple[torch.Tensor, torch.Tensor]:
    """Left padding, as generate expects for decoder-only models -> (input_ids, attention_mask) [B, W]."""
    width = max(len(x) for x in ids)
    inp = torch.zeros(len(ids), width, dtype=torch.long)
    mask = torch.zeros(len(ids), width, dtype=torch.long)
    for i, x in enumerate(ids):
        inp[i, width - len(x):] = torch.tensor(x)
        mask[i, width - len(x):] = 1
    return inp.to(dev), mask.to(dev)
