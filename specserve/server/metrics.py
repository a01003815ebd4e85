"""Prometheus metrics of the server (``GET /metrics``), on a registry of its own."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from specserve.core.request import RequestOutput

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class ServerMetrics:
    def __init__(self, engine) -> None:
        self.engine = engine
        r = self.registry = CollectorRegistry()
        self.requests = Counter("specserve_requests", "Finished requests by finish reason", ["finish_reason"],
                                registry=r)
        self.rejected = Counter("specserve_rejected_requests", "Requests refused (bad input, queue full)", ["reason"],
                                registry=r)
        self.prompt_tokens = Counter("specserve_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generated_tokens = Counter("specserve_generated_tokens", "Generated tokens", registry=r)
        self.ttft = Histogram("specserve_time_to_first_token_seconds", "TTFT", buckets=_LATENCY, registry=r)
        self.tpot = Histogram("specserve_time_per_output_token_seconds", "TPOT", buckets=_LATENCY, registry=r)
        self.e2e = Histogram("specserve_e2e_request_latency_seconds", "End-to-end latency", buckets=_LATENCY,
                             registry=r)
        self.running = Gauge("specserve_num_requests_running", "Requests running", registry=r)
        self.waiting = Gauge("specserve_num_requests_waiting", "Requests waiting", registry=r)
        self.kv_usage = Gauge("specserve_kv_cache_usage_ratio", "Fraction of KV blocks in use", registry=r)
        self.kv_free = Gauge("specserve_kv_cache_free_blocks", "Free KV blocks", registry=r)
        self.prefix_hit = Gauge("specserve_prefix_cache_hit_rate",
                                "Share of full prompt blocks found in the prefix cache", registry=r)
        self.prefix_queried = Gauge("specserve_prefix_cache_queried_blocks", "Prompt blocks looked up (total)",
                                    registry=r)
        self.drafted = Gauge("specserve_spec_draft_tokens", "Draft tokens verified (total)", registry=r)
        self.accepted = Gauge("specserve_spec_accepted_tokens", "Draft tokens accepted (total)", registry=r)
        self.accept_len = Gauge("specserve_spec_acceptance_length", "Emitted tokens per verify step", registry=r)
        self.per_pos = Gauge("specserve_spec_acceptance_per_position", "Acceptance of each draft position",
                             ["position"], registry=r)
        self.draft_len = Gauge("specserve_spec_draft_len", "Drafts a row the last speculative step proposed",
                               registry=r)
        self.steps_by_len = Gauge("specserve_spec_steps_by_draft_len", "Speculative steps by the drafts a row they "
                                  "proposed (total)", ["draft_len"], registry=r)

    def observe_finished(self, out: RequestOutput) -> None:
        self.requests.labels(out.finish_reason or "unknown").inc()
        self.prompt_tokens.inc(len(out.prompt_token_ids))
        self.generated_tokens.inc(len(out.token_ids))
        t = out.timings()
        for hist, key in ((self.ttft, "ttft_s"), (self.tpot, "tpot_s"), (self.e2e, "e2e_s")):
            if t.get(key) is not None:
                hist.observe(t[key])

    def render(self) -> bytes:
        eng = self.engine
        self.running.set(len(eng.scheduler.running))
        self.waiting.set(len(eng.scheduler.waiting))
        self.kv_usage.set(eng.pool.usage())
        self.kv_free.set(eng.pool.num_free)
        self.prefix_hit.set(eng.pool.hit_rate or 0.0)
        self.prefix_queried.set(eng.pool.queried)
        s = eng.spec_stats
        self.drafted.set(s.num_drafted)
        self.accepted.set(s.num_accepted)
        self.accept_len.set(s.acceptance_length or 0.0)
        for j, v in enumerate(s.per_position):
            self.per_pos.labels(str(j)).set(v)
        if s.draft_len_history:
            self.draft_len.set(s.draft_len_history[-1][0])
        for d, n in enumerate(s.steps_by_draft_len):
            self.steps_by_len.labels(str(d)).set(n)
        return generate_latest(self.registry)
