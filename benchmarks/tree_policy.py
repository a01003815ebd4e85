"""What a tree engine's choice between the tree and chains of 1..D weighs, as it runs: the step costs measured at
engine start by option (chains of 1..D drafts, then the tree), then after each of three runs of the chat prompts the
steps by drafts proposed; at the end the live cost estimates for the batch's rows, the expected tokens by option and
the rent owed per (graph layout, option) (``speculative/tree_choice.py``).

    python benchmarks/tree_policy.py --model /root/model.gguf --draft specserve/heads/smollm2-135m-eagle3 \\
        --tree 4x6x24 --batch 1 32
"""

from __future__ import annotations

import argparse
import time

import torch

from specserve import LLM, SamplingParams
from specserve.bench.prompts import DEFAULT_PROMPTS


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--tree", default="4x6x24", metavar="KxDxN", help="topk x depth x nodes (a ':B' suffix is ignored)")
    ap.add_argument("--method", default="eagle3", help="the head's kind: eagle3 or mtp (MTP-Eagle)")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--kv-cache-memory", type=int, default=4_000_000_000)
    a = ap.parse_args()
    k, d, n = (int(x) for x in a.tree.split(":")[0].split("x"))
    for batch in a.batch:
        spec = dict(method=a.method, draft_model=a.draft, max_draft_len=d, topk=k, max_total_draft_tokens=n)
        llm = LLM(a.model, max_num_seqs=batch, speculative_config=spec, kv_cache_memory_bytes=a.kv_cache_memory)
        policy, tok = llm.engine.draft_policy, llm.engine.tokenizer
        if policy.costs is None:
            raise SystemExit("no step costs: the engine chooses by cost only on CUDA graphs, for a tree of more "
                             "nodes than its depth")
        print(f"=== batch {batch}: options (drafts) {policy.drafts}; start-up step ms by rows:")
        for rows, sec in zip(policy.costs.buckets, policy.costs.seconds):
            print(f"  {rows:4d} rows: {[round(t * 1e3, 3) for t in sec]}")
        ids = [tok.apply_chat_template([{"role": "user", "content": t}]) for t in DEFAULT_PROMPTS]
        prompts = [{"prompt_token_ids": ids[i % len(ids)]} for i in range(max(len(ids), batch))]
        sp = SamplingParams(temperature=0, max_tokens=256)
        for r in range(a.runs):
            t0 = time.perf_counter()
            llm.generate(prompts, sp, use_tqdm=False)
            torch.cuda.synchronize()
            by = {i: x for i, x in enumerate(llm.engine.spec_stats.steps_by_draft_len) if x}
            print(f"  run {r}: {time.perf_counter() - t0:.3f} s; steps by drafts so far {by}")
        print(f"  live step ms at {batch} rows: {[round(t * 1e3, 3) for t in policy.live.row(batch)]}")
        print(f"  expected tokens: {[round(float(t), 3) for t in policy.expected_tokens()]}")
        print(f"  rent owed ms: {sorted(round(v * 1e3, 1) for v in policy.rent.owed.values())}; "
              f"captures {llm.engine.runner.graphs.captures}")
        del llm


if __name__ == "__main__":
    main()
