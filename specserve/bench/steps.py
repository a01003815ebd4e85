"""GPU time of the pieces of one engine step, against the memory roofline (``specserve bench --steps``).

With B requests at a given context length in the generation phase, three CUDA graphs are timed by replaying
them (device events, median): a plain decode step (target forward for 1 token per row + lm_head +
sampling), a verify step (target forward for 1 + D tokens per row + lm_head at every position), and the
speculative engine's own captured step (verify + acceptance + the whole draft loop). The draft loop's time
is the speculative step minus the verify step. Rooflines: weight bytes over the device-to-device copy
bandwidth measured in the same run (bytes read + written) of the weight bytes a step reads: every target
weight once, except an input embedding not tied to the output layer (a step reads one row of it per token;
the JSON also gives the fraction over all weights), and for the draft loop each draft step's modules and
output layer (``DraftHead.draft_read_bytes``).
"""

from __future__ import annotations

import statistics

import torch

from specserve.runner.graph_layout import GraphLayout
from specserve.runner.model_runner import ModelRunner
from specserve.scheduler.scheduler import ScheduledRequest, SchedulerOutput


def target_read_bytes(model: torch.nn.Module) -> int:
    """Weight bytes a target forward reads: all, less an untied input embedding (one row per token)."""
    skip = {id(model.embed_tokens.weight)} if model.lm_weight() is not model.embed_tokens.weight else set()
    return sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in skip)


def replay_ms(graph: torch.cuda.CUDAGraph, repeats: int = 50, warmup: int = 5) -> float:
    for _ in range(warmup):
        graph.replay()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def capture_graph(fn) -> torch.cuda.CUDAGraph:
    """``fn`` run once on a side stream (warm-up: Triton compilation, cuBLAS workspaces), then captured."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


def graph_us(fn, calls: int) -> float:
    """Median replay of ``fn`` captured in one CUDA graph, in microseconds per call (``fn`` makes ``calls``)."""
    return replay_ms(capture_graph(fn)) * 1e3 / calls


@torch.inference_mode()
def step_times(llm, batch: int, context: int, bandwidth_gbps: float, seed: int = 0) -> dict:
    """``llm``: an LLM with a speculative config on CUDA. Returns milliseconds and roofline ratios."""
    from specserve import SamplingParams

    eng = llm.engine
    runner = eng.runner
    d = runner.speculator.draft_len
    g = torch.Generator().manual_seed(seed)
    vocab = eng.model_config.vocab_size
    sp = SamplingParams(temperature=0, max_tokens=10_000, ignore_eos=True)
    rids = [eng.add_request(torch.randint(10, vocab, (context,), generator=g).tolist(), sp) for _ in range(batch)]
    reqs = [eng.requests[r] for r in rids]
    # prefill (as many steps as the token budget needs), then speculative steps until the engine has
    # captured the graph of the layout its next step uses
    entries = SchedulerOutput([ScheduledRequest(r, r.num_computed_tokens, d + 1, True, d) for r in reqs])
    spec_graphs: list = []
    for _ in range(context * batch // 64 + 16):
        eng.step()
        if all(r.num_output_tokens >= 2 for r in reqs):
            entries = SchedulerOutput([ScheduledRequest(r, r.num_computed_tokens, d + 1, True, d) for r in reqs])
            layout = runner.graph_layout(entries)
            spec_graphs = runner.graphs.captured_for(layout) if layout is not None else []
            if spec_graphs:
                break
    if not spec_graphs:
        raise ValueError(f"batch {batch}: the speculative step never ran as a CUDA graph (does the KV cache hold "
                         f"{batch} requests of {context} tokens? see --kv-cache-memory)")
    spec_ms = replay_ms(spec_graphs[-1])
    plain = ModelRunner(eng.model, eng.kv_cache, eng.device, max_model_len=eng.max_model_len)

    def layout_record(q: int):
        """A graph step's record for every request with q tokens (the device expands it inside the graph,
        as in an engine step)."""
        entries = [ScheduledRequest(r, r.num_computed_tokens, q, True, q - 1) for r in reqs]
        for r in reqs:  # drafts to verify (values do not matter for timing)
            r.spec_token_ids = (r.spec_token_ids + [0] * d)[:q - 1]
        lay = GraphLayout(layout.rows, q, layout.table_width)
        rec, switches = plain.stage_graph(SchedulerOutput(entries), lay)
        return rec, switches, lay

    rec1 = layout_record(1)
    decode = capture_graph(lambda: plain.step(plain.graph_batch(*rec1)))
    decode_ms = replay_ms(decode)
    recq = layout_record(d + 1)

    def verify():
        inp = plain.graph_batch(*recq)
        hidden, aux = eng.model(inp.input_ids, inp.positions, inp.meta, plain.kv_views,
                                aux_layers=runner.aux_layers)
        return eng.model.compute_logits(hidden).argmax(-1)

    verify_ms = replay_ms(capture_graph(verify))
    for r in rids:
        eng.abort_request(r)

    target_bytes = target_read_bytes(eng.model)
    all_bytes = sum(p.numel() * p.element_size() for p in eng.model.parameters())
    bw = bandwidth_gbps * 1e9
    decode_roof = target_bytes / bw * 1e3
    draft_loop_ms = spec_ms - verify_ms
    draft_bytes = eng.head.draft_read_bytes(d, batch)
    draft_roof = draft_bytes / bw * 1e3
    return dict(batch=batch, context=context, draft_len=d, decode_ms=decode_ms, verify_ms=verify_ms,
                spec_step_ms=spec_ms, draft_loop_ms=draft_loop_ms, target_bytes=target_bytes,
                target_all_weight_bytes=all_bytes, draft_loop_bytes=draft_bytes,
                decode_roofline_ms=decode_roof, decode_fraction_of_roofline=decode_roof / decode_ms,
                decode_fraction_of_all_weights_roofline=all_bytes / bw * 1e3 / decode_ms,
                verify_over_decode=verify_ms / decode_ms, draft_loop_roofline_ms=draft_roof,
                draft_loop_over_roofline=draft_loop_ms / draft_roof, copy_bandwidth_gbps=bandwidth_gbps)
