"""Acceptance and speed of the shipped heads under greedy and sampled decoding, and relaxed acceptance
against delta and top-k.

Part 1: for each temperature, the same chat prompts decoded with speculation off and on (shipped EAGLE-3
head, D = 4, seeded requests); tokens/s is the median of ``--repeats`` timed runs after one warm-up.
Part 2: relaxed acceptance (greedy) over a delta x top-k grid. SmolLM2 has no thinking tokens, so the phase
is opened by <|im_start|> (the assistant turn) and closed by <|im_end|>: the whole reply is "thinking".

    python benchmarks/bench_accept.py [--device cuda] [--model FILE] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from specserve import LLM, SamplingParams
from specserve.heads import default_speculative_config

from specserve.bench.prompts import CHATS



def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run(llm: LLM, prompts, params, repeats: int, device: str) -> tuple[float, dict | None]:
    llm.generate(prompts, params)  # warm-up
    times, outs = [], None
    for _ in range(repeats):
        if llm.engine.spec_config is not None:
            llm.engine.spec_stats.__init__()
        sync(device)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        sync(device)
        times.append(time.perf_counter() - t0)
    tokens = sum(len(o.token_ids) for o in outs)
    spec = llm.engine.spec_stats.as_dict() if llm.engine.spec_config is not None else None
    return tokens / statistics.median(times), spec


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.7, 1.0])
    p.add_argument("--deltas", type=float, nargs="+", default=[0.05, 0.1, 0.2, 0.3])
    p.add_argument("--topks", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--kv-bytes", type=int, default=1 << 30)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    common = dict(device=a.device, dtype=a.dtype, kv_cache_memory_bytes=a.kv_bytes)
    plain = LLM(a.model, **common)
    prompts = [{"prompt_token_ids": plain.tokenizer.apply_chat_template([{"role": "user", "content": c}])}
               for c in CHATS]
    spec = LLM(a.model, speculative_config=default_speculative_config("eagle3", 4), **common)
    rows = []
    for t in a.temperatures:
        params = [SamplingParams(temperature=t, max_tokens=a.max_tokens, seed=i) for i in range(len(prompts))]
        off, _ = run(plain, prompts, params, a.repeats, a.device)
        on, st = run(spec, prompts, params, a.repeats, a.device)
        rows.append(dict(part="temperature", temperature=t, tokens_per_s_off=off, tokens_per_s_on=on,
                         acceptance_length=st["acceptance_length"], per_position=st["per_position_acceptance"]))
        print(f"T={t}: {off:.1f} -> {on:.1f} tokens/s ({on / off:.2f}x), AL {st['acceptance_length']:.2f}, "
              f"per position {[round(x, 2) for x in st['per_position_acceptance']]}", flush=True)
    del spec, plain
    greedy = SamplingParams(temperature=0, max_tokens=a.max_tokens)
    grid = [(0.0, 1)] + [(d, k) for k in a.topks for d in a.deltas]
    for delta, topk in grid:
        cfg = dict(default_speculative_config("eagle3", 4), use_relaxed_acceptance_for_thinking=True,
                   relaxed_topk=topk, relaxed_delta=delta, begin_thinking_phase_token="<|im_start|>",
                   end_thinking_phase_token="<|im_end|>")
        llm = LLM(a.model, speculative_config=cfg, **common)
        llm.generate(prompts, greedy)
        st = llm.engine.spec_stats
        rows.append(dict(part="relaxed", delta=delta, topk=topk, acceptance_length=st.acceptance_length,
                         per_position=st.per_position))
        print(f"relaxed delta={delta} topk={topk}: AL {st.acceptance_length:.2f}", flush=True)
        del llm
    meta = dict(date=time.strftime("%Y-%m-%d"),
                device=torch.cuda.get_device_name() if a.device.startswith("cuda") else "cpu",
                torch=torch.__version__, max_tokens=a.max_tokens, prompts=len(CHATS), draft_len=4)
    print(json.dumps(meta))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
