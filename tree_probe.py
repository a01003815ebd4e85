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
    choose = pol.choose
    log = collections.Counter()
    def tc(requests, generation=False, captured=None, verifying=0):
        d = choose(requests, generation, captured, verifying)
        if generation and len(requests) == batch:
            has = "".join("1" if captured is not None and captured.graph_runs(*pol.step_graph(pol.drafts[o], o)) else "0" for o in range(len(pol.drafts)))
            log[(d, verifying, has)] += 1
        return d
    pol.choose = tc
    for r in range(3):
        log.clear()
        t0 = time.perf_counter(); llm.generate([{"prompt_token_ids": x} for x in ids], sp, use_tqdm=False); torch.cuda.synchronize()
        print(" run", r, round(time.perf_counter() - t0, 3), "s", sorted(log.items())[:20])
    print(" live ms", [round(t*1e3, 3) for t in pol.live.row(batch)])
    print(" tokens", [round(float(t), 3) for t in pol.expected_tokens()])
    print(" owed", {str(k[1]): round(v*1e3, 2) for k, v in pol.rent.owed.items()}, "captures", llm.engine.runner.graphs.captures)
    del llm
