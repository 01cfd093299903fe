"""Prometheus text exposition for /metrics: HTTP requests by route and status, interactive tokens and latency,
and the engine's per-step statistics. Plain text: a handful of counters does not need prometheus_client."""
from __future__ import annotations

import threading
from collections import Counter

TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
ENGINE_GAUGES = {"running": "requests running in the engine (all lanes)",
                 "waiting": "requests waiting in the engine (all lanes)",
                 "kv_blocks_used": "KV cache blocks in use", "kv_blocks_free": "KV cache blocks free"}
ENGINE_COUNTERS = {"step": ("steps", "engine steps"), "preemptions": ("preemptions", "requests preempted"),
                   "prefix_cache_hit_tokens": ("prefix_cache_hit_tokens", "prompt tokens served from the prefix cache"),
                   "prompt_tokens": ("prompt_tokens", "prompt tokens processed (recompute included)"),
                   "output_tokens": ("output_tokens", "tokens generated")}


class ServerMetrics:
    def __init__(self):
        self._lock = threading.Lock()
        self.requests: Counter = Counter()          # (route, status) -> count
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.in_flight = 0
        self.ttft_buckets = [0] * len(TTFT_BUCKETS)
        self.ttft_sum, self.ttft_count = 0.0, 0

    def count_request(self, route: str, status: int) -> None:
        with self._lock:
            self.requests[(route, status)] += 1

    def count_tokens(self, prompt: int, completion: int) -> None:
        with self._lock:
            self.prompt_tokens += prompt
            self.completion_tokens += completion

    def observe_ttft(self, seconds: float) -> None:
        with self._lock:
            for i, bound in enumerate(TTFT_BUCKETS):
                if seconds <= bound:
                    self.ttft_buckets[i] += 1
            self.ttft_sum += seconds
            self.ttft_count += 1

    def render(self, engine_stats) -> str:
        lines: list[str] = []

        def metric(name, kind, help_, samples):
            lines.extend([f"# HELP batchrun_{name} {help_}", f"# TYPE batchrun_{name} {kind}"])
            lines.extend(f"batchrun_{name}{labels} {value}" for labels, value in samples)

        with self._lock:
            metric("http_requests_total", "counter", "HTTP requests by route and status code",
                   [(f'{{route="{r}",status="{s}"}}', n) for (r, s), n in sorted(self.requests.items())])
            metric("http_requests_in_flight", "gauge", "interactive requests being served", [("", self.in_flight)])
            metric("interactive_prompt_tokens_total", "counter", "prompt tokens of served requests",
                   [("", self.prompt_tokens)])
            metric("interactive_completion_tokens_total", "counter", "tokens generated for served requests",
                   [("", self.completion_tokens)])
            samples = [(f'_bucket{{le="{b}"}}', n) for b, n in zip(TTFT_BUCKETS, self.ttft_buckets)]
            samples += [('_bucket{le="+Inf"}', self.ttft_count), ("_sum", round(self.ttft_sum, 6)),
                        ("_count", self.ttft_count)]
            metric("interactive_time_to_first_token_seconds", "histogram",
                   "seconds from arrival in the server to the first token", samples)
        for field, help_ in ENGINE_GAUGES.items():
            metric(f"engine_{field}", "gauge", help_, [("", getattr(engine_stats, field))])
        for field, (name, help_) in ENGINE_COUNTERS.items():
            metric(f"engine_{name}_total", "counter", help_, [("", getattr(engine_stats, field))])
        return "\n".join(lines) + "\n"
