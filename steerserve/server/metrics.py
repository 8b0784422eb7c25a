"""Prometheus metrics, split by steering arm, in a registry owned by one app (tests run several)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class Metrics:
    """``arm`` label values: steered, unsteered, ab (both arms of an A/B call), none (refused
    before steering was decided). The ``steerserve_ab_*`` series are the server-side experiment's
    arms (assigned, whether or not the steering applied to the prompt)."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._serving(self.registry)
        self._experiment(self.registry)

    def _serving(self, r: CollectorRegistry) -> None:
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
        self.preset_requests = Counter(
            "steerserve_preset_requests",
            "Requests whose model id is a steering preset, by preset and HTTP status.",
            ["preset", "status"],
            registry=r,
        )
        self.stream_stalls = Counter(
            "steerserve_stream_stalls",
            "Streams cancelled because one write waited for the client to read longer than "
            "--stream-send-timeout-seconds (their engine requests aborted, their buffers freed).",
            registry=r,
        )
        self.ready = Gauge("steerserve_engine_ready", "1 once the engine is loaded.", registry=r)
        self.engine_requests = Gauge(
            "steerserve_engine_requests",
            "Requests handed to the engine and not finished (vLLM's unfinished requests): the "
            "queue gauge minus those still being admitted or already answered.",
            registry=r,
        )

    def _experiment(self, r: CollectorRegistry) -> None:
        ab = ["experiment", "arm"]  # arm: steered | unsteered | unenrolled
        self.ab_requests = Counter(
            "steerserve_ab_requests",
            "Requests under the A/B experiment by experiment, arm and HTTP status.",
            [*ab, "status"],
            registry=r,
        )
        self.ab_tokens = Counter(
            "steerserve_ab_tokens",
            "Tokens under the A/B experiment by experiment, arm and kind (prompt, completion).",
            [*ab, "kind"],
            registry=r,
        )
        self.ab_latency = Histogram(
            "steerserve_ab_request_latency_seconds",
            "Request latency under the A/B experiment by experiment and arm.",
            ab,
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.ab_log_failures = Counter(
            "steerserve_ab_log_failures",
            "Decision-log writes that failed (a full disk...); the requests were still answered.",
            registry=r,
        )
        # the experiment store (--ab-store): every record is written, queued or dropped
        self.ab_store_written = Counter(
            "steerserve_ab_store_written",
            "Records (decisions, feedback) this process wrote to the experiment store.",
            registry=r,
        )
        self.ab_store_queued = Gauge(
            "steerserve_ab_store_queued",
            "Records waiting in this process for the experiment store (bounded; they queue "
            "while it is unreachable and are written in order when it is back).",
            registry=r,
        )
        self.ab_store_dropped = Counter(
            "steerserve_ab_store_dropped",
            "Records that never reached the experiment store: the queue was full, the store "
            "refused them (feedback over the cap), or they could not be kept at shutdown.",
            registry=r,
        )
        self.ab_store_up = Gauge(
            "steerserve_ab_store_up",
            "1 while the experiment store takes this process's writes, 0 while they queue.",
            registry=r,
        )

    def observe(self, endpoint: str, arm: str, status: int, seconds: float | None) -> None:
        self.requests.labels(endpoint, arm, str(status)).inc()
        if seconds is not None:
            self.latency.labels(endpoint, arm).observe(seconds)

    def count_tokens(self, arm: str, prompt: int, completion: int) -> None:
        if prompt:
            self.tokens.labels(arm, "prompt").inc(prompt)
        if completion:
            self.tokens.labels(arm, "completion").inc(completion)

    def observe_ab(
        self, name: str, arm: str, status: int, seconds: float | None, tokens: tuple[int, int]
    ) -> None:
        self.ab_requests.labels(name, arm, str(status)).inc()
        if seconds is not None:
            self.ab_latency.labels(name, arm).observe(seconds)
        for kind, n in zip(("prompt", "completion"), tokens, strict=True):
            if n:
                self.ab_tokens.labels(name, arm, kind).inc(n)

    def render(self) -> bytes:
        """Ours, then what vLLM's engine publishes in prometheus_client's default registry (its
        ``vllm:*`` metrics, which dashboards and autoscalers key on, as ``vllm serve`` shows
        them, and the process collectors)."""
        from prometheus_client import REGISTRY

        return generate_latest(self.registry) + generate_latest(REGISTRY)
