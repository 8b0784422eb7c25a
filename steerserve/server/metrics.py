"""Prometheus metrics, split by steering arm, in a registry owned by one app (tests run several)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class Metrics:
    """``arm`` label values: steered, unsteered, ab (both arms of an A/B call), none (refused
    before steering was decided)."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.queue_depth = Gauge(
            "steerserve_queue_depth",
            "Generation requests in flight (queued or running).",
            registry=r,
        )
        self.requests = Counter(
            "steerserve_requests",
            "Requests by endpoint, steering arm and HTTP status (499: client went away).",
            ["endpoint", "arm", "status"],
            registry=r,
        )
        self.tokens = Counter(
            "steerserve_tokens",
            "Tokens by steering arm and kind (prompt, completion).",
            ["arm", "kind"],
            registry=r,
        )
        self.latency = Histogram(
            "steerserve_request_latency_seconds",
            "Request latency (until the last byte of a stream) by endpoint and steering arm.",
            ["endpoint", "arm"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.ready = Gauge("steerserve_engine_ready", "1 once the engine is loaded.", registry=r)

    def observe(self, endpoint: str, arm: str, status: int, seconds: float | None) -> None:
        self.requests.labels(endpoint, arm, str(status)).inc()
        if seconds is not None:
            self.latency.labels(endpoint, arm).observe(seconds)

    def count_tokens(self, arm: str, prompt: int, completion: int) -> None:
        if prompt:
            self.tokens.labels(arm, "prompt").inc(prompt)
        if completion:
            self.tokens.labels(arm, "completion").inc(completion)

    def render(self) -> bytes:
        return generate_latest(self.registry)
