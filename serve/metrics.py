"""The service's Prometheus metrics (``GET /metrics``), in a registry of their own so two servers in one process
(tests, benchmarks) never share counts.

Labels take registry names the server serves (``"-"`` for a name it does not), never request text, so their
number stays bounded.
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# Seconds: a tiny model answers in milliseconds, SmolLM2 on a CPU in about 0.2-2 s, a long queue in tens of seconds.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
# Prompt tokens a request read in one pass: bounded by ``ServeLimits.prefill_tokens`` (64 by default).
PREFILL_BUCKETS = (8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


class ServeMetrics:
    """Counters, histograms and gauges of one server; safe to update from any thread."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "tooltrie_discover_requests", "Discovery requests (HTTP and MCP) by registry and outcome: ok, or the "
            "error code (invalid_request, unknown_registry, queue_full, timeout, client_closed_request, ...)",
            ["registry", "outcome"], registry=self.registry)
        self.latency = Histogram(
            "tooltrie_discover_latency_seconds",
            "Arrival to answer of successful discovery requests, queueing included",
            ["registry"], buckets=LATENCY_BUCKETS, registry=self.registry)
        self.batch_rows = Histogram(
            "tooltrie_batch_rows", "Rows decoded in each engine step (admission, then a forward pass), by registry",
            ["registry"], buckets=BATCH_BUCKETS, registry=self.registry)
        self.prefill_tokens = Histogram(
            "tooltrie_prefill_tokens", "Prompt tokens one request read in an engine step (the largest of the step's "
            "rows), by registry: a long query is read in chunks of at most ServeLimits.prefill_tokens",
            ["registry"], buckets=PREFILL_BUCKETS, registry=self.registry)
        self.cancelled = Counter(
            "tooltrie_cancelled_requests", "Requests cancelled (timeout or client gone) by where they were: "
            "waiting (never decoded) or decoding (their slot freed at the next step)",
            ["stage"], registry=self.registry)
        self.http_responses = Counter(
            "tooltrie_http_responses", "HTTP responses by status code, errors included", ["status"],
            registry=self.registry)
        self.reloads = Counter(
            "tooltrie_registry_reloads", "Registry reloads by registry and outcome (ok or the error code)",
            ["registry", "outcome"], registry=self.registry)
        self.adapter_swaps = Counter(
            "tooltrie_adapter_swaps", "Adapters trained while serving and swapped in, by registry", ["registry"],
            registry=self.registry)
        self.training_steps = Gauge(
            "tooltrie_adapter_training_steps", "Steps done of the adapter being trained or last trained, by registry "
            "(tooltrie_adapter_training_total_steps: of how many)", ["registry"], registry=self.registry)
        self.training_total = Gauge(
            "tooltrie_adapter_training_total_steps", "Steps of the adapter training queued, running or done, by "
            "registry", ["registry"], registry=self.registry)
        self.training_failed = Gauge(
            "tooltrie_adapter_training_failed", "1 where a registry's last adapter training failed (its error, a "
            "time limit included, is in /v1/registries), else 0", ["registry"], registry=self.registry)
        self.queued = Gauge("tooltrie_queued_requests", "Requests accepted and not yet decoding",
                            registry=self.registry)
        self.active_rows = Gauge("tooltrie_active_rows", "Rows being decoded, over all engines",
                                 registry=self.registry)

    def exposition(self) -> bytes:
        """The Prometheus text format of every metric."""
        return generate_latest(self.registry)
