"""Greedy generation throughput of specserve, optionally side by side with transformers ``generate``.

Both engines run the same model file, the same chat prompts and the same number of new tokens (EOS
ignored) in one process; each configuration is warmed up once, then timed ``--repeats`` times with the
device synchronised, and the median is reported.

    python benchmarks/bench_generate.py --batch 1 16 --max-tokens 128 [--compare-hf] [--model FILE]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

from specserve.bench.prompts import CHATS as ALL_CHATS
from specserve.bench.hf import left_padded

CHATS = ALL_CHATS[:8]  # the set behind this script's figures (docs/BENCHMARKS.md at commit d1401ab)



def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn, device: str, repeats: int) -> list[float]:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return times


def bench_specserve(args, prompts_ids) -> list[dict]:
    from specserve import LLM, SamplingParams

    llm = LLM(model=args.model, device=args.device, dtype=args.dtype, kv_cache_memory_bytes=args.kv_bytes)
    sp = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    rows = []
    for b in args.batch:
        batch = [{"prompt_token_ids": prompts_ids[i % len(prompts_ids)]} for i in range(b)]
        last = {}

        def run():
            last["outs"] = llm.generate(batch, sp)

        times = timed(run, args.device, args.repeats)
        outs = last["outs"]
        tpot = statistics.median(o.timings()["tpot_s"] for o in outs)
        ttft = statistics.median(o.timings()["ttft_s"] for o in outs)
        med = statistics.median(times)
        rows.append(dict(engine="specserve", batch=b, new_tokens=args.max_tokens, seconds=med,
                         tokens_per_s=b * args.max_tokens / med, tpot_ms=tpot * 1e3, ttft_ms=ttft * 1e3,
                         all_seconds=times, first_tokens=outs[0].token_ids[:16]))
    return rows


def bench_hf(args, prompts_ids) -> list[dict]:
    from transformers import AutoModelForCausalLM

    from specserve.loaders import resolve_model_path

    path = resolve_model_path(args.model)
    dtype = {"auto": torch.bfloat16 if args.device.startswith("cuda") else torch.float32,
             "bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}[args.dtype]
    if path.is_file():
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    model = model.to(args.device).eval()
    rows = []
    for b in args.batch:
        inp, mask = left_padded([prompts_ids[i % len(prompts_ids)] for i in range(b)], args.device)
        width = inp.shape[1]
        last = {}

        def run():
            with torch.no_grad():
                last["out"] = model.generate(input_ids=inp, attention_mask=mask, max_new_tokens=args.max_tokens,
                                             min_new_tokens=args.max_tokens, do_sample=False, pad_token_id=0)

        times = timed(run, args.device, args.repeats)
        med = statistics.median(times)
        rows.append(dict(engine="transformers", batch=b, new_tokens=args.max_tokens, seconds=med,
                         tokens_per_s=b * args.max_tokens / med, all_seconds=times,
                         first_tokens=last["out"][0, width:width + 16].tolist()))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF folder or .gguf (default: the embedded SmolLM2)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--kv-bytes", type=int, default=2 << 30, help="KV cache bytes for specserve")
    p.add_argument("--compare-hf", action="store_true", help="also time transformers generate")
    p.add_argument("--json", default=None, help="write all rows to this file")
    args = p.parse_args()

    from specserve.tokenizer import Tokenizer
    from specserve.loaders import resolve_model_path

    path = resolve_model_path(args.model)
    tok = Tokenizer.from_gguf(path) if path.is_file() else Tokenizer.from_folder(path)
    prompts_ids = [tok.apply_chat_template([{"role": "user", "content": c}]) for c in CHATS]

    rows = bench_specserve(args, prompts_ids)
    if args.compare_hf:
        rows += bench_hf(args, prompts_ids)
    dev = torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor() or "cpu"
    meta = dict(date=time.strftime("%Y-%m-%d"), device=dev, torch=torch.__version__, threads=torch.get_num_threads(),
                dtype=args.dtype, model=str(path))
    print(json.dumps(meta))
    print(f"{'engine':<13}{'batch':>6}{'new tok':>9}{'median s':>10}{'tok/s':>10}{'TPOT ms':>9}")
    for r in rows:
        tpot = f"{r['tpot_ms']:.2f}" if "tpot_ms" in r else "-"
        print(f"{r['engine']:<13}{r['batch']:>6}{r['new_tokens']:>9}{r['seconds']:>10.3f}{r['tokens_per_s']:>10.1f}"
              f"{tpot:>9}")
    by = {(r["engine"], r["batch"]): r for r in rows}
    for b in args.batch:
        if ("transformers", b) in by:
            s, h = by[("specserve", b)], by[("transformers", b)]
            same = s["first_tokens"] == h["first_tokens"]
            print(f"batch {b}: specserve / transformers = {s['tokens_per_s'] / h['tokens_per_s']:.2f}x "
                  f"(first 16 tokens identical: {same})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
