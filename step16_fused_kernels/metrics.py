"""The server's Prometheus metrics, under vLLM's names (``vllm/v1/metrics/loggers.py``).

The engine loop (async_engine.py) updates them after every step; ``GET /metrics`` (api_server.py) exposes
them in Prometheus's text format. Source: vLLM's ``PrometheusStatLogger``; prometheus_client's
``Gauge``, ``Counter``, ``Histogram``.
"""

from __future__ import annotations

import os

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, multiprocess


class ByEngine:
    """A metric family labelled ``model_name`` and ``engine``: ``.labels(e)`` is core e's child."""

    def __init__(self, family, model_name: str):
        self.family, self.model_name = family, model_name
        self.children: dict[int, object] = {}  # by core: a dict lookup per token, not the family's lock

    def labels(self, engine: int):
        child = self.children.get(engine)
        if child is None:
            child = self.children[engine] = self.family.labels(self.model_name, str(engine))
        return child


class ServerMetrics:
    """Prometheus metrics under vLLM's names (``vllm/v1/metrics/loggers.py``), labels ``model_name`` and
    ``engine`` (the core's index, as vLLM labels them): ``metrics.running.labels(engine)``.

    Gauges: ``vllm:num_requests_running``, ``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc``
    (0..1). Counters (exposed with the suffix ``_total``): ``vllm:num_preemptions``, ``vllm:prompt_tokens``,
    ``vllm:generation_tokens``, ``vllm:request_success`` (+ label ``finished_reason``: stop, length, abort),
    ``vllm:prefix_cache_queries`` and ``vllm:prefix_cache_hits`` (tokens: hits / queries is the hit rate),
    ``vllm:spec_decode_num_drafts`` (verifications), ``vllm:spec_decode_num_draft_tokens``,
    ``vllm:spec_decode_num_accepted_tokens``, ``vllm:spec_decode_num_accepted_tokens_per_pos`` (+ label
    ``position``: 0 for the first draft).
    Histograms, seconds, measured by the server's clock (``time.perf_counter``) from the moment the handler
    submitted the request: ``vllm:time_to_first_token_seconds``, ``vllm:inter_token_latency_seconds``
    (between two outputs of a choice: n series for n choices), ``vllm:e2e_request_latency_seconds``,
    ``vllm:request_queue_time_seconds`` (submitted -> the start of the step that ran its prefill); and
    ``vllm:iteration_tokens_total``, the tokens of each engine step (prompt chunks and decodes together).
    n choices count as n requests (vLLM's child requests): n samples, n successes, the prompt tokens n times.
    ``vllm:cache_config_info`` (1, labels block_size and num_gpu_blocks: the pool of each core, for
    prefix-aware routers). Each app has its own ``CollectorRegistry``, so that several apps can live in one
    process (tests). Several frontends (``PROMETHEUS_MULTIPROC_DIR`` set): each writes its figures to that
    directory and ``/metrics`` sums them (prometheus_client's multiprocess mode, as vLLM); a gauge shows
    the value set last by any frontend.
    """

    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        r = self.registry

        by_engine = ["model_name", "engine"]

        def gauge(name: str, doc: str) -> ByEngine:
            family = Gauge(name, doc, by_engine, registry=r, multiprocess_mode="mostrecent")
            return ByEngine(family, model_name)

        def counter(name: str, doc: str) -> ByEngine:
            return ByEngine(Counter(name, doc, by_engine, registry=r), model_name)

        def histogram(name: str, doc: str, buckets: list[float]) -> ByEngine:
            return ByEngine(Histogram(name, doc, by_engine, buckets=buckets, registry=r), model_name)

        self.running = gauge("vllm:num_requests_running", "Requests in the running batch.")
        self.waiting = gauge(
            "vllm:num_requests_waiting", "Requests waiting to be scheduled (engine + inbox)."
        )
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0..1).")
        self.preemptions = counter("vllm:num_preemptions", "Preemptions (requests evicted and recomputed).")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens prefilled.")
        self.generation_tokens = counter("vllm:generation_tokens", "Tokens generated.")
        self.prefix_cache_queries = counter(
            "vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        )
        self.prefix_cache_hits = counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.spec_drafts = counter("vllm:spec_decode_num_drafts", "Speculative verifications (one per lane).")
        self.spec_draft_tokens = counter("vllm:spec_decode_num_draft_tokens", "Draft tokens proposed.")
        self.spec_accepted_tokens = counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self._spec_accepted_per_pos = Counter(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by position in the draft.",
            ["model_name", "engine", "position"],
            registry=r,
        )
        self._success = Counter(
            "vllm:request_success",
            "Requests finished, by finish reason.",
            ["model_name", "engine", "finished_reason"],
            registry=r,
        )
        self._cache_config = Gauge(
            "vllm:cache_config_info",
            "The KV cache's configuration, in labels (the value is 1).",
            ["model_name", "engine", "block_size", "num_gpu_blocks"],
            registry=r,
            multiprocess_mode="mostrecent",
        )
        self._model_name = model_name
        self.ttft = histogram(
            "vllm:time_to_first_token_seconds",
            "Time to first token (s).",
            [
                0.001,
                0.005,
                0.01,
                0.02,
                0.04,
                0.06,
                0.08,
                0.1,
                0.25,
                0.5,
                0.75,
                1.0,
                2.5,
                5.0,
                7.5,
                10.0,
                20.0,
                40.0,
                80.0,
            ],
        )
        self.itl = histogram(
            "vllm:inter_token_latency_seconds",
            "Time between two outputs of a request (s).",
            [
                0.001,
                0.0025,
                0.005,
                0.01,
                0.025,
                0.05,
                0.075,
                0.1,
                0.15,
                0.2,
                0.3,
                0.4,
                0.5,
                0.75,
                1.0,
                2.5,
                5.0,
            ],
        )
        self.e2e = histogram(
            "vllm:e2e_request_latency_seconds",
            "Request latency, submitted to finished (s).",
            [
                0.1,
                0.3,
                0.5,
                0.8,
                1.0,
                1.5,
                2.0,
                2.5,
                5.0,
                10.0,
                15.0,
                20.0,
                30.0,
                40.0,
                50.0,
                60.0,
                120.0,
                240.0,
            ],
        )
        self.queue_time = histogram(
            "vllm:request_queue_time_seconds",
            "Time waiting before the prefill (s).",
            [0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0],
        )

        self.iteration_tokens = histogram(
            "vllm:iteration_tokens_total",
            "Tokens per engine step.",
            [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384],
        )

    def success(self, engine: int, finished_reason: str) -> None:
        self._success.labels(self._model_name, str(engine), finished_reason).inc()

    def spec_accepted_at(self, engine: int, position: int, n: int) -> None:
        """n more drafts accepted at ``position`` (0: a verification's first draft)."""
        self._spec_accepted_per_pos.labels(self._model_name, str(engine), str(position)).inc(n)

    def cache_config(self, engine: int, block_size: int, num_blocks: int) -> None:
        self._cache_config.labels(self._model_name, str(engine), str(block_size), str(num_blocks)).set(1)

    def exposition(self) -> bytes:
        """The text format: this app's registry, or every frontend's figures summed (multiprocess mode)."""
        if "PROMETHEUS_MULTIPROC_DIR" not in os.environ:
            return generate_latest(self.registry)
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        return generate_latest(registry)
