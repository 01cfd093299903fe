"""Prometheus metrics for /metrics (prometheus_client, one registry per server): HTTP requests by route and status,
interactive tokens and latency, and the engine's per-step statistics, read when scraped."""
from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
ENGINE_GAUGES = {"running": "requests running in the engine (all lanes)",
                 "waiting": "requests waiting in the engine (all lanes)",
                 "kv_blocks_used": "KV cache blocks in use", "kv_blocks_free": "KV cache blocks free"}
ENGINE_COUNTERS = {"step": ("steps", "engine steps"), "preemptions": ("preemptions", "requests preempted"),
                   "prefix_cache_hit_tokens": ("prefix_cache_hit_tokens", "prompt tokens served from the prefix cache"),
                   "prompt_tokens": ("prompt_tokens", "prompt tokens processed (recompute included)"),
                   "output_tokens": ("output_tokens", "tokens generated")}


class _EngineCollector:
    """The engine keeps its own cumulative StepStats; they are exported as they are at scrape time."""

    def __init__(self, stats: Callable[[], object]):
        self.stats = stats

    def collect(self):
        s = self.stats()
        for field, help_ in ENGINE_GAUGES.items():
            yield GaugeMetricFamily(f"batchrun_engine_{field}", help_, value=getattr(s, field))
        for field, (name, help_) in ENGINE_COUNTERS.items():
            yield CounterMetricFamily(f"batchrun_engine_{name}", help_, value=getattr(s, field))


class ServerMetrics:
    def __init__(self, engine_stats: Callable[[], object]):
        self.registry = registry = CollectorRegistry()
        self.requests = Counter("batchrun_http_requests", "HTTP requests by route and status code",
                                ["route", "status"], registry=registry)
        self.in_flight = Gauge("batchrun_http_requests_in_flight", "interactive requests being served",
                               registry=registry)
        self.prompt_tokens = Counter("batchrun_interactive_prompt_tokens", "prompt tokens of served requests",
                                     registry=registry)
        self.completion_tokens = Counter("batchrun_interactive_completion_tokens",
                                         "tokens generated for served requests", registry=registry)
        self.ttft = Histogram("batchrun_interactive_time_to_first_token_seconds",
                              "seconds from arrival in the server to the first token", buckets=TTFT_BUCKETS,
                              registry=registry)
        registry.register(_EngineCollector(engine_stats))

    def count_request(self, route: str, status: int) -> None:
        self.requests.labels(route=route, status=str(status)).inc()

    def count_tokens(self, prompt: int, completion: int) -> None:
        self.prompt_tokens.inc(prompt)
        self.completion_tokens.inc(completion)

    def observe_ttft(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def render(self) -> str:
        return generate_latest(self.registry).decode()
