"""`GET /metrics`: every loaded model's engine in Prometheus text format (each sample labelled `model`), through
prometheus_client.

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


class _FleetCollector:
    """Every loaded model's engine at scrape time, each sample labelled with its model; and each listed model's
    state (`model_loaded`: 1 loaded, 0 not)."""

    def __init__(self, fleet):
        self.fleet = fleet

    def collect(self):
        families: dict = {}

        def add(kind, name, doc, value, model, extra=None):
            labels = ["model"] + sorted(extra or {})
            key = (kind, name)
            if key not in families:
                cls = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
                families[key] = cls(f"{NS}_{name}", doc, labels=labels)
            families[key].add_metric([model] + [str(v) for _, v in sorted((extra or {}).items())], value)

        for name, entry in self.fleet.entries.items():
            add("gauge", "model_loaded", "1 while the model is loaded (its agents serve), 0 while it is not",
                1 if entry.state == "loaded" else 0, name)
            add("counter", "model_loads", "Times the model was loaded (or tried)", entry.loads, name)
            add("counter", "model_load_waits", "Requests that waited for the model to load", entry.waits, name)
            add("counter", "model_load_wait_seconds", "Seconds requests waited for the model to load, summed",
                entry.wait_s, name)
        for name, e in self.fleet.engines():
            sched, bm = e.scheduler, e.block_manager
            gauge = lambda metric, doc, value, extra=None: add("gauge", metric, doc, value, name, extra)  # noqa: E731
            counter = lambda metric, doc, value, extra=None: add("counter", metric, doc, value, name, extra)  # noqa: E731
            used = bm.num_blocks - bm.num_free_blocks
            gauge("up", "1 while the engine can serve, 0 while agents are down, it gave up or drains",
                  0 if e.unavailable_reason() else 1)
            gauge("num_requests_running", "Requests in the running batch", len(sched.running))
            gauge("num_requests_waiting", "Requests queued for admission", len(sched.waiting))
            gauge("kv_blocks_total", "KV cache blocks", bm.num_blocks)
            gauge("kv_blocks_used", "KV cache blocks held by requests", used)
            gauge("kv_cache_usage_ratio", "Share of KV cache blocks held by requests", used / bm.num_blocks)
            if bm.window_pool is not None:          # sliding-window layers' own cache (pa_config.window_blocks)
                pool = bm.window_pool
                gauge("kv_window_blocks_total", "Window-pool blocks (sliding-window layers)", pool.num_blocks)
                gauge("kv_window_blocks_used", "Window-pool blocks held by requests", pool.num_blocks - pool.num_free)
            counter("prompt_tokens", "Prompt tokens of admitted requests", e.num_prompt_tokens)
            counter("generation_tokens", "Tokens generated", e.num_generated_tokens)
            counter("steps", "Steps run on the agents", e.num_steps)
            counter("preemptions", "Running requests preempted for KV space (recomputed later)",
                    sched.num_preemptions)
            counter("agent_restarts", "Times the agent group was restarted after a failure", e.num_agent_restarts)
            spec = e.spec_stats
            counter("spec_verify_steps", "Verify steps run (speculative decoding)", spec.verify_steps)
            counter("spec_proposed_tokens", "Tokens proposed for speculating requests", spec.proposed)
            counter("spec_accepted_tokens", "Proposed tokens the target model kept", spec.accepted)
            counter("spec_rounds", "Rows that speculated in a verify step", spec.rounds)
            for pos, rate in spec.as_dict()["acceptance_by_position"].items():
                gauge("spec_acceptance_by_position", "Share of speculating rows whose proposal at this position "
                      "(1-based) was kept", rate, {"position": pos})
            for reason in ("stop", "length", "abort", "error"):
                counter("requests_finished", "Requests ended, by finish reason", e.num_finished.get(reason, 0),
                        {"finish_reason": reason})
        yield from families.values()


class Metrics:
    """The registry of one server: its fleet's collector, and the latency histograms of every model, filled by each
    engine's finish listener (attached as the model loads)."""

    def __init__(self, fleet):
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_FleetCollector(fleet))
        self.ttft = Histogram(f"{NS}_time_to_first_token_seconds", "Arrival to first token", ["model"],
                              buckets=LATENCY_BUCKETS, registry=self.registry)
        self.tpot = Histogram(f"{NS}_time_per_output_token_seconds", "Mean time per output token after the "
                              "first, per request", ["model"], buckets=TPOT_BUCKETS, registry=self.registry)
        self.e2e = Histogram(f"{NS}_e2e_request_latency_seconds", "Arrival to the end of the request", ["model"],
                             buckets=LATENCY_BUCKETS, registry=self.registry)
        for name, engine in fleet.engines():
            self.attach(name, engine)
        fleet.listeners.append(self.attach)

    def attach(self, name: str, engine) -> None:
        """A model loaded (engine) or unloaded (None): its requests' latencies are observed under its name."""
        if engine is not None:
            for histogram in (self.ttft, self.tpot, self.e2e):
                histogram.labels(name)             # (listed from the start, empty)
            engine.finish_listeners.append(lambda req: self.observe(name, req))

    def observe(self, name: str, req) -> None:
        self.e2e.labels(name).observe(req.finish_time - req.arrival_time)
        if req.first_token_time is not None:
            self.ttft.labels(name).observe(req.first_token_time - req.arrival_time)
            if len(req.output_ids) > 1:
                self.tpot.labels(name).observe((req.finish_time - req.first_token_time) / (len(req.output_ids) - 1))


async def metrics(request: web.Request) -> web.Response:
    body = generate_latest(request.app[METRICS].registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


def add_routes(app: web.Application, fleet) -> None:
    app[METRICS] = Metrics(fleet)
    app.router.add_get("/metrics", metrics)
