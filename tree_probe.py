import collections, time, torch
from specserve import LLM, SamplingParams
from specserve.bench.prompts import DEFAULT_PROMPTS
for batch in (1, 32):
    spec = dict(method="eagle3", draft_model="specserve/heads/smollm2-135m-eagle3", max_draft_len=6, topk=4,
                max_total_draft_tokens=24)
    llm = LLM("/root/model.gguf", max_num_seqs=batch, speculative_config=spec, kv_cache_memory_bytes=4_000_000_000)
    pol = llm.engine.draft_policy
    print("batch", batch, "costs ms", [[round(t*1e3, 3) for t in s] for s in pol.costs.seconds], pol.costs.buckets)
    tok = llm.engine.tokenizer
    ids = [tok.apply_chat_template([{"role": "user", "content": t}]) for t in DEFAULT_PROMPTS]
    ids = [ids[i % 16] for i in range(max(16, batch))]
    sp = SamplingParams(temperature=0, max_tokens=256)
    for r in range(3):
        t0 = time.perf_counter(); llm.generate([{"prompt_token_ids": x} for x in ids], sp, use_tqdm=False); torch.cuda.synchronize()
        print(" run", r, round(time.perf_counter() - t0, 3), "s", llm.engine.spec_stats.steps_by_draft_len)
    print(" live ms", [round(t*1e3, 3) for t in pol.live.row(batch)])
    print(" tokens", [round(float(t), 3) for t in pol.expected_tokens()])
    print(" owed ms", sorted(round(v*1e3, 1) for v in pol.rent.owed.values()), "captures", llm.engine.runner.graphs.captures)
    del llm
