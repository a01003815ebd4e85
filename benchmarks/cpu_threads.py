"""Decode and prefill speed of the default model on the CPU at several torch intra-op thread counts (the measurement
behind ``config.default_cpu_threads``; docs/BENCHMARKS.md, "CPU defaults").

    python benchmarks/cpu_threads.py decode 2,1          # plain decoding, 48 tokens, threads 2 then 1, twice
    python benchmarks/cpu_threads.py decode-spec 2,1     # the same with the shipped EAGLE-3 head (D = 4)
    python benchmarks/cpu_threads.py prefill 2,1         # one 1024-token prompt, max_tokens 1
"""

import sys
import time

import torch

from specserve import LLM, SamplingParams
from specserve.heads import default_speculative_config

mode, threads = sys.argv[1], [int(x) for x in sys.argv[2].split(",")]
kw = dict(speculative_config=default_speculative_config("eagle3")) if mode == "decode-spec" else {}
if mode == "prefill":
    kw["max_num_seqs"] = 1
llm = LLM(**kw)
if mode == "prefill":
    p, prompt = SamplingParams(temperature=0, max_tokens=1), {"prompt_token_ids": list(range(1000, 2024))}
else:
    p, prompt = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True), "Write a short story about a robot."
llm.generate("Hi", SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)  # warm-up
for _ in range(2):
    for t in threads:
        torch.set_num_threads(t)
        t0 = time.perf_counter()
        out = llm.generate(prompt, p, use_tqdm=False)[0]
        dt = time.perf_counter() - t0
        n = len(out.prompt_token_ids) if mode == "prefill" else len(out.token_ids)
        print(f"{mode} threads={t}: {n} tokens in {dt:.2f} s ({n / dt:.1f} tokens/s)", flush=True)
