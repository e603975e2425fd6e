"""Prometheus metrics for `GET /metrics`, named the way vLLM names them, with our own prefix.

Latencies are measured with `time.monotonic()` from the moment the request arrived (so time to
first token includes queueing and tokenization, as in vLLM). The headline figure of a batch-1
engine is the per-request decode speed, so it gets its own histogram:
`expresslane:request_decode_tokens_per_second`. Every metric carries a `model_name` label.
Each app has its own registry, so several servers can live in one process (tests).
"""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

PREFIX = "expresslane:"
FINISH_REASONS = ("stop", "length", "abort")

TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
                1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
ITL_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08,
               0.1, 0.25, 0.5, 1.0, 2.5)  # fmt: skip
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0,
               30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0)  # fmt: skip
# Per-request decode tokens/s: from a CPU toy model up to multi-GPU batch-1 speeds (~3,000).
TPS_BUCKETS = (1, 5, 10, 25, 50, 100, 200, 300, 400, 500, 750, 1000, 1250, 1500, 2000, 2500,
               3000, 4000, 5000, 7500, 10000)  # fmt: skip


class Metrics:
    """The server's metrics, already bound to one model name."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None):
        self.model_name = model_name
        self.registry = r = registry or CollectorRegistry()
        label = ["model_name"]

        def hist(name: str, doc: str, buckets) -> Histogram:
            return Histogram(PREFIX + name, doc, label, buckets=buckets, registry=r).labels(
                model_name
            )

        self.ttft = hist(
            "time_to_first_token_seconds", "Request arrival to first generated token.", TTFT_BUCKETS
        )
        self.itl = hist(
            "inter_token_latency_seconds",
            "Time between consecutive generated tokens of a request.",
            ITL_BUCKETS,
        )
        self.e2e = hist(
            "e2e_request_latency_seconds",
            "Request arrival to the end of its generation.",
            E2E_BUCKETS,
        )
        self.queue_time = hist(
            "request_queue_time_seconds", "Time a request waited in the queue.", E2E_BUCKETS
        )
        self.decode_tps = hist(
            "request_decode_tokens_per_second",
            "Per-request decode speed: (tokens - 1) / (last - first token).",
            TPS_BUCKETS,
        )
        self.prompt_tokens = Counter(
            PREFIX + "prompt_tokens", "Prompt tokens processed.", label, registry=r
        ).labels(model_name)
        self.generation_tokens = Counter(
            PREFIX + "generation_tokens", "Tokens generated.", label, registry=r
        ).labels(model_name)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(PREFIX + name, doc, label, registry=r).labels(model_name)

        self.running = gauge("num_requests_running", "Requests on the engine now (batch 1: 0, 1).")
        self.waiting = gauge("num_requests_waiting", "Requests waiting in the queue.")
        self.capture_seconds = gauge(
            "graph_capture_seconds",
            "Seconds spent capturing CUDA graphs, at load and between requests (never in one).",
        )
        self.warmup_seconds = gauge(
            "prefill_warmup_seconds",
            "Seconds spent in prefill warm-up at load (first-use costs no request pays).",
        )
        self.cpu_threads = gauge(
            "cpu_threads",
            "CPU threads the decode step runs on, revised before each request (0: not a CPU).",
        )
        self.preparing = gauge(
            "num_requests_preparing",
            "Requests being parsed, templated and tokenized (they count toward --max-queue).",
        )
        self._rejected = Counter(
            PREFIX + "request_rejected",
            "Requests refused before any work: queue_full (503), too_large (413).",
            label + ["reason"],
            registry=r,
        )
        for reason in ("queue_full", "too_large"):
            self._rejected.labels(model_name, reason)
        self._finished = Counter(
            PREFIX + "request_success",
            "Finished sequences by finish reason (stop, length, abort).",
            label + ["finished_reason"],
            registry=r,
        )
        for reason in FINISH_REASONS:  # expose zeros from the start
            self._finished.labels(model_name, reason)
        # prefix reuse, in vLLM's terms: queries and hits count tokens
        self.prefix_queries = Counter(
            PREFIX + "prefix_cache_queries", "Prompt tokens looked up in the KV cache.", label,
            registry=r,
        ).labels(model_name)  # fmt: skip
        self.prefix_hits = Counter(
            PREFIX + "prefix_cache_hits", "Prompt tokens the KV cache held (not prefilled).",
            label, registry=r,
        ).labels(model_name)  # fmt: skip
        self.prefix_hit_requests = Counter(
            PREFIX + "prefix_cache_hit_requests", "Prompts that reused a cached prefix.", label,
            registry=r,
        ).labels(model_name)  # fmt: skip
        # speculative decoding (vLLM's names): verify steps, drafted and accepted tokens
        self.spec_drafts, self.spec_draft_tokens, self.spec_accepted_tokens = (
            Counter(PREFIX + name, doc, label, registry=r).labels(model_name)
            for name, doc in (
                ("spec_decode_num_drafts", "Speculative verify steps (one draft each)."),
                ("spec_decode_num_draft_tokens", "Draft tokens proposed by prompt lookup."),
                ("spec_decode_num_accepted_tokens", "Draft tokens the model accepted."),
            )
        )

    def cache_config(self, cache_dtype: str, max_model_len: int, nbytes: int) -> None:
        """The KV cache as loaded: vLLM's `cache_config_info` (a 1 labelled with its config) and
        its bytes."""
        labels = ["cache_dtype", "max_model_len", "model_name"]  # sorted, as exposed
        info = Gauge(PREFIX + "cache_config_info", "The KV cache's configuration (labels).",
                     labels, registry=self.registry)  # fmt: skip
        info.labels(cache_dtype, str(max_model_len), self.model_name).set(1)
        size = Gauge(PREFIX + "kv_cache_bytes", "Bytes of keys and values allocated at load.",
                     ["model_name"], registry=self.registry)  # fmt: skip
        size.labels(self.model_name).set(nbytes)

    def speculated(self, figures: dict) -> None:
        """One finished sequence's speculation figures (SpecStats.as_dict)."""
        self.spec_drafts.inc(figures["verify_steps"])
        self.spec_draft_tokens.inc(figures["draft_tokens"])
        self.spec_accepted_tokens.inc(figures["accepted_tokens"])

    def finished(self, reason: str) -> None:
        self._finished.labels(self.model_name, reason).inc()

    def rejected(self, reason: str) -> None:
        self._rejected.labels(self.model_name, reason).inc()

    def prefix_lookup(self, prompt_tokens: int, cached_tokens: int) -> None:
        self.prefix_queries.inc(prompt_tokens)
        self.prefix_hits.inc(cached_tokens)
        if cached_tokens:
            self.prefix_hit_requests.inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


def parse_metrics(text: str) -> dict[str, float]:
    """Plain `name{labels} value` lines -> {name{labels}: value} (for tests and tools)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out
