"""Acceptance of a draft head for the default model on the CPU (float32, greedy, chain of D = 4).

Prompt sets: ``holdout`` (held-out prompts of a train-draft run's data.pt), ``train`` (prompts it trained
on), ``humaneval`` and ``alpaca`` (files named with --humaneval / --alpaca). With ``--simulate`` the same
responses are also scored by a teacher-forced simulation of the draft loop (training-time-test attention,
the head fed its own outputs, the walk of verify steps replayed on the target's greedy response): if it
matches the engine, inference drafts exactly what training optimises. With ``--per-prompt FILE`` each prompt
is generated alone and its acceptance written to FILE (JSONL), with the set's acceptance by response length.

    python benchmarks/head_acceptance.py --method eagle3 --head specserve/heads/smollm2-135m-eagle3 \\
        --data regen/data.pt --sets holdout humaneval alpaca --num 32 --max-tokens 128 \\
        --humaneval HumanEval.jsonl.gz --alpaca alpaca-seed-tasks.jsonl [--simulate] [--per-prompt OUT.jsonl]
"""

from __future__ import annotations

import argparse
import json

import torch

from specserve import LLM, SamplingParams
from specserve.train.attention import TrainingTimeTest
from specserve.train.prompts import read_prompts
from specserve.train.trainer import target_features


def simulated_acceptance(head, prompt: list[int], response: list[int], d: int) -> tuple[int, list[int]]:
    """Verify steps and per-position accepted counts of drafting ``response`` after ``prompt``."""
    seq = torch.tensor([prompt + response])
    s = seq.shape[1]
    with torch.no_grad():
        hidden, aux = target_features(head.target, head, seq)
        h, tta, pos = head.first_hidden(hidden, aux), TrainingTimeTest(), torch.arange(s)[None]
        preds = []  # preds[k][i]: draft k from anchor i (predicts the token at i + k + 2)
        for k in range(d):
            ids = torch.zeros_like(seq)
            ids[:, :s - k - 1] = seq[:, k + 1:]
            h = head.run_module(k, ids, pos + k, h, tta, (None, None))
            preds.append(head.draft_ids(k, h[0]).tolist())
    steps, per_pos = 0, [0] * d
    i = len(prompt) - 1  # the first draft step follows the prefill's token at len(prompt)
    while i + 2 < s:
        acc = 0
        while acc < d and i + acc + 2 < s and preds[acc][i] == seq[0, i + acc + 2].item():
            acc += 1
        steps += 1
        for k in range(acc):
            per_pos[k] += 1
        i += acc + 1
    return steps, per_pos


LENGTHS = (0, 32, 96, 200)  # response-length buckets (tokens) of the --per-prompt summary


def per_prompt(llm, name: str, prompts: list[list[int]], texts: list[str], max_tokens: int, f) -> None:
    """Generate each prompt alone; write its acceptance to ``f`` and print the set's by response length."""
    rows = []
    for i, (ids, text) in enumerate(zip(prompts, texts)):
        llm.engine.spec_stats = type(llm.engine.spec_stats)()
        out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=max_tokens),
                           use_tqdm=False)[0]
        st = llm.engine.spec_stats
        rows.append(dict(set=name, index=i, tokens=len(out.token_ids), verify_steps=st.num_verify_steps,
                         emitted=st.num_emitted, acceptance_length=st.acceptance_length,
                         per_position=st.per_position, prompt=text, response=out.text))
        f.write(json.dumps(rows[-1]) + "\n")
        f.flush()
    edges = tuple(x for x in LENGTHS if x <= max_tokens) + (max_tokens + 1,)
    for lo, hi in zip(edges, edges[1:]):
        sel = [r for r in rows if lo <= r["tokens"] < hi]
        steps = sum(r["verify_steps"] for r in sel)
        if steps:
            al = sum(r["emitted"] for r in sel) / steps
            print(f"{name}: responses of {lo}-{hi - 1} tokens: {len(sel)} prompts, "
                  f"{sum(r['tokens'] for r in sel)} tokens, AL {al:.3f}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--method", choices=["eagle3", "mtp"], required=True)
    ap.add_argument("--head", required=True)
    ap.add_argument("--data", help="a train-draft data.pt (for the holdout and train sets)")
    ap.add_argument("--sets", nargs="+", default=["holdout"], choices=["holdout", "train", "humaneval", "alpaca"])
    ap.add_argument("--humaneval")
    ap.add_argument("--alpaca")
    ap.add_argument("--num", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--simulate", action="store_true")
    ap.add_argument("--per-prompt", metavar="FILE", help="also generate each prompt alone; JSONL of each one's acceptance")
    a = ap.parse_args()
    d = 4
    llm = LLM(None, device="cpu", dtype="float32", max_num_seqs=64,
              speculative_config=dict(method=a.method, draft_model=a.head, max_draft_len=d))
    chat = lambda p: llm.tokenizer.apply_chat_template([{"role": "user", "content": p}])  # noqa: E731
    data = torch.load(a.data) if a.data else None
    per_prompt_file = open(a.per_prompt, "w") if a.per_prompt else None
    for name in a.sets:
        if name in ("holdout", "train") and data is None:
            raise SystemExit(f"--sets {name} needs --data")
        if name == "holdout":
            texts = data["holdout_prompts"][:a.num]
            prompts = [chat(p) for p in texts]
        elif name == "train":
            prompts = [x["prompt_ids"] for x in data["train"][:a.num]]
            texts = [llm.tokenizer.decode(p) for p in prompts]
        else:
            path = a.humaneval if name == "humaneval" else a.alpaca
            if not path:
                raise SystemExit(f"--sets {name} needs --{name} FILE")
            texts = read_prompts([path])[:a.num]
            prompts = [chat(p) for p in texts]
        llm.engine.spec_stats = type(llm.engine.spec_stats)()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0, max_tokens=a.max_tokens))
        st = llm.engine.spec_stats
        line = f"{name}: engine AL {st.acceptance_length:.3f} per position " + \
            " ".join(f"{x:.3f}" for x in st.per_position)
        if a.simulate:
            steps, per_pos = 0, [0] * d
            for p, o in zip(prompts, outs):
                n, pp = simulated_acceptance(llm.engine.head, p, o.token_ids, d)
                steps += n
                per_pos = [x + y for x, y in zip(per_pos, pp)]
            line += f" | simulated AL {1 + sum(per_pos) / steps:.3f} per position " + \
                " ".join(f"{x / steps:.3f}" for x in per_pos)
        print(line, flush=True)
        if per_prompt_file:
            per_prompt(llm, name, prompts, texts, a.max_tokens, per_prompt_file)


if __name__ == "__main__":
    main()
