"""Acceptance of the shipped EAGLE-3 head when its draft argmax only sees the first N token ids (a smaller
draft vocabulary taken from the target's lm_head in BPE merge order, a stand-in for token frequency).
Greedy, so outputs must not change; prints AL and per-position acceptance per N.

    python benchmarks/draft_vocab_acceptance.py [--sizes 32768 16384 8192] [--max-tokens 96]
                                                [--humaneval .traindata/HumanEval.jsonl.gz]
"""

from __future__ import annotations

import argparse
import gzip
import json
import time

import torch.nn.functional as F

from specserve import LLM, SamplingParams
from specserve.bench.prompts import DEFAULT_PROMPTS
from specserve.core.metrics import SpecStats
from specserve.heads import default_speculative_config
from specserve.kernels.argmax import argmax_lastdim
from specserve.speculative import heads

_full_vocab_draft_ids = heads.Eagle3Head.draft_ids
SIZE: int | None = None  # the draft vocabulary the patched argmax sees (None: all ids)


def first_n_draft_ids(self, step, out, dest=None):
    if SIZE is None:
        return _full_vocab_draft_ids(self, step, out, dest)
    t = self.target
    w = t.embed_tokens.weight if t.lm_head is None else t.lm_head.weight  # [V, H]
    return argmax_lastdim(F.linear(self.norm(out), w[:SIZE]))  # ids < SIZE are target ids


def main() -> None:
    global SIZE
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[32768, 16384, 8192, 4096])
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--humaneval", default=".traindata/HumanEval.jsonl.gz")
    a = ap.parse_args()
    he = [json.loads(line)["prompt"] for line in gzip.open(a.humaneval, "rt")][100:112]  # not trained on
    chats = [[{"role": "user", "content": p}] for p in DEFAULT_PROMPTS[:12]]
    chats += [[{"role": "user", "content": "Complete this Python function:\n" + p}] for p in he]
    heads.Eagle3Head.draft_ids = first_n_draft_ids
    llm = LLM(None, device="cpu", dtype="float32", speculative_config=default_speculative_config("eagle3", 4))
    sp = SamplingParams(temperature=0, max_tokens=a.max_tokens)
    ref = None
    for n in [None, *a.sizes]:
        SIZE = n
        llm.engine.spec_stats = SpecStats()
        t0 = time.time()
        toks = [o.token_ids for o in llm.chat(chats, sp)]
        ref = ref or toks
        st = llm.engine.spec_stats
        print(f"{n or 'all'}: AL {st.acceptance_length:.3f} per position "
              f"{' '.join(f'{x:.2f}' for x in st.per_position)} outputs {'same' if toks == ref else 'DIFFERENT'} "
              f"({time.time() - t0:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
