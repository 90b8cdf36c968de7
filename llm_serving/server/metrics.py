"""`GET /metrics`: the engine in Prometheus text format, through prometheus_client.

Gauges and counters are read from the engine when scraped (nothing is counted twice). The latency
histograms are filled as requests end: TTFT (arrival to first token), TPOT (mean time per output token
after the first) and E2E (arrival to the end), in seconds. Each server has its own registry, so
several servers in one process (tests) do not mix their numbers.
"""
from __future__ import annotations

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from llm_serving.server.keys import METRICS

NS = "llm_serving"
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class _EngineCollector:
    """The engine's state at scrape time."""

    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        e, sched, bm = self.engine, self.engine.scheduler, self.engine.block_manager
        labels = ["model"]
        model = [e.model_name]

        def gauge(name, doc, value):
            g = GaugeMetricFamily(f"{NS}_{name}", doc, labels=labels)
            g.add_metric(model, value)
            return g

        def counter(name, doc, value):
            c = CounterMetricFamily(f"{NS}_{name}", doc, labels=labels)
            c.add_metric(model, value)
            return c

        used = bm.num_blocks - bm.num_free_blocks
        yield gauge("up", "1 while the engine can serve, 0 while agents are down, it gave up or drains",
                    0 if e.unavailable_reason() else 1)
        yield gauge("num_requests_running", "Requests in the running batch", len(sched.running))
        yield gauge("num_requests_waiting", "Requests queued for admission", len(sched.waiting))
        yield gauge("kv_blocks_total", "KV cache blocks", bm.num_blocks)
        yield gauge("kv_blocks_used", "KV cache blocks held by requests", used)
        yield gauge("kv_cache_usage_ratio", "Share of KV cache blocks held by requests", used / bm.num_blocks)
        if bm.window_pool is not None:          # sliding-window layers' own cache (pa_config.window_blocks)
            pool = bm.window_pool
            yield gauge("kv_window_blocks_total", "Window-pool blocks (sliding-window layers)", pool.num_blocks)
            yield gauge("kv_window_blocks_used", "Window-pool blocks held by requests", pool.num_blocks - pool.num_free)
        yield counter("prompt_tokens", "Prompt tokens of admitted requests", e.num_prompt_tokens)
        yield counter("generation_tokens", "Tokens generated", e.num_generated_tokens)
        yield counter("steps", "Steps run on the agents", e.num_steps)
        yield counter("preemptions", "Running requests preempted for KV space (recomputed later)",
                      sched.num_preemptions)
        yield counter("agent_restarts", "Times the agent group was restarted after a failure", e.num_agent_restarts)
        spec = e.spec_stats
        yield counter("spec_verify_steps", "Verify steps run (speculative decoding)", spec.verify_steps)
        yield counter("spec_proposed_tokens", "Tokens proposed for speculating requests", spec.proposed)
        yield counter("spec_accepted_tokens", "Proposed tokens the target model kept", spec.accepted)
        yield counter("spec_rounds", "Rows that speculated in a verify step", spec.rounds)
        by_pos = GaugeMetricFamily(f"{NS}_spec_acceptance_by_position", "Share of speculating rows whose proposal "
                                   "at this position (1-based) was kept", labels=labels + ["position"])
        for pos, rate in spec.as_dict()["acceptance_by_position"].items():
            by_pos.add_metric(model + [pos], rate)
        yield by_pos
        finished = CounterMetricFamily(f"{NS}_requests_finished", "Requests ended, by finish reason",
                                       labels=labels + ["finish_reason"])
        for reason in ("stop", "length", "abort", "error"):
            finished.add_metric(model + [reason], e.num_finished.get(reason, 0))
        yield finished


class Metrics:
    def __init__(self, engine):
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_EngineCollector(engine))
        name = engine.model_name
        self.ttft = Histogram(f"{NS}_time_to_first_token_seconds", "Arrival to first token", ["model"],
                              buckets=LATENCY_BUCKETS, registry=self.registry).labels(name)
        self.tpot = Histogram(f"{NS}_time_per_output_token_seconds", "Mean time per output token after the "
                              "first, per request", ["model"], buckets=TPOT_BUCKETS, registry=self.registry).labels(name)
        self.e2e = Histogram(f"{NS}_e2e_request_latency_seconds", "Arrival to the end of the request", ["model"],
                             buckets=LATENCY_BUCKETS, registry=self.registry).labels(name)
        engine.finish_listeners.append(self.observe)

    def observe(self, req) -> None:
        self.e2e.observe(req.finish_time - req.arrival_time)
        if req.first_token_time is not None:
            self.ttft.observe(req.first_token_time - req.arrival_time)
            if len(req.output_ids) > 1:
                self.tpot.observe((req.finish_time - req.first_token_time) / (len(req.output_ids) - 1))


async def metrics(request: web.Request) -> web.Response:
    body = generate_latest(request.app[METRICS].registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


def add_routes(app: web.Application, engine) -> None:
    app[METRICS] = Metrics(engine)
    app.router.add_get("/metrics", metrics)
