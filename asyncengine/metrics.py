"""Prometheus metrics of one engine (``GET /metrics``), named after vLLM's under ``asyncengine:``.

Each ``EngineMetrics`` owns its ``CollectorRegistry``, so several engines (or tests) in one
process never collide. The engine calls the ``on_*`` methods from its event loop; the server
calls ``set_stats`` and ``render`` when ``/metrics`` is scraped.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from asyncengine.core.sched.interface import SchedulerStats

FINISH_REASONS = ("stop", "length", "abort")

# Bucket edges as vLLM uses them (seconds).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
               1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000)

PREFIX = "asyncengine:"


class EngineMetrics:
    """The engine's gauges, counters and histograms, labelled with ``model_name``."""

    def __init__(self, model_name: str = "default") -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        labels = ["model_name"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(PREFIX + name, doc, labels, registry=self.registry).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(PREFIX + name, doc, labels, registry=self.registry).labels(model_name)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(PREFIX + name, doc, labels, buckets=buckets,
                             registry=self.registry).labels(model_name)

        self.num_running = gauge("num_requests_running", "Requests in the running batch.")
        self.num_waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_cache_usage = gauge("kv_cache_usage_perc",
                                    "Fraction of KV-cache blocks in use (0..1).")
        self.free_blocks = gauge("kv_cache_free_blocks", "KV-cache blocks free or evictable.")
        self.total_blocks = gauge("kv_cache_total_blocks", "KV-cache blocks in the pool.")
        self.prefix_hit_rate = gauge("prefix_cache_hit_rate",
                                     "Prefix-cache hits / queries, in tokens, since start.")
        self.prefix_queries = counter("prefix_cache_queries",
                                      "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.preemptions = counter("num_preemptions", "Requests preempted (by recompute).")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens computed (prefill).")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.",
                              TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between output tokens.",
                             ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Request latency, arrival to "
                             "finish.", E2E_BUCKETS)
        self.request_prompt_tokens = histogram("request_prompt_tokens",
                                               "Prompt length of finished requests.",
                                               TOKEN_BUCKETS)
        self.request_generation_tokens = histogram("request_generation_tokens",
                                                   "Output length of finished requests.",
                                                   TOKEN_BUCKETS)
        finished = Counter(PREFIX + "request_finished", "Finished requests by finish reason.",
                           ["model_name", "finished_reason"], registry=self.registry)
        self.finished = {r: finished.labels(model_name, r) for r in FINISH_REASONS}
        self._finished_family = finished
        self._last_queries = 0
        self._last_hits = 0
        self._last_preemptions = 0

    # -- called by the engine -------------------------------------------------------------------
    def on_step(self, stats: SchedulerStats, num_prompt_tokens: int,
                num_generation_tokens: int) -> None:
        """After each step: the scheduler's state and the tokens this step computed."""
        self._set_stats(stats)
        if num_prompt_tokens:
            self.prompt_tokens.inc(num_prompt_tokens)
        if num_generation_tokens:
            self.generation_tokens.inc(num_generation_tokens)

    def on_first_token(self, ttft_s: float) -> None:
        self.ttft.observe(ttft_s)

    def on_token(self, itl_s: float) -> None:
        self.itl.observe(itl_s)

    def on_request_finished(self, e2e_s: float, finish_reason: str, num_prompt_tokens: int,
                            num_generation_tokens: int) -> None:
        self.e2e.observe(e2e_s)
        counter = self.finished.get(finish_reason)
        if counter is None:
            counter = self.finished[finish_reason] = self._finished_family.labels(
                self.model_name, finish_reason)
        counter.inc()
        self.request_prompt_tokens.observe(num_prompt_tokens)
        self.request_generation_tokens.observe(num_generation_tokens)

    # -- called by the server -------------------------------------------------------------------
    def set_stats(self, stats: SchedulerStats) -> None:
        """Refresh the gauges from the scheduler (at scrape time, between steps)."""
        self._set_stats(stats)

    def render(self) -> bytes:
        """The Prometheus text exposition of this registry."""
        return generate_latest(self.registry)

    # -- helpers --------------------------------------------------------------------------------
    def _set_stats(self, stats: SchedulerStats) -> None:
        self.num_running.set(stats.num_running)
        self.num_waiting.set(stats.num_waiting)
        self.kv_cache_usage.set(stats.kv_cache_usage)
        self.free_blocks.set(stats.num_free_blocks)
        self.total_blocks.set(stats.num_total_blocks)
        # The scheduler's prefix-cache and preemption numbers are cumulative: add the growth.
        if stats.prefix_cache_queries > self._last_queries:
            self.prefix_queries.inc(stats.prefix_cache_queries - self._last_queries)
            self._last_queries = stats.prefix_cache_queries
        if stats.prefix_cache_hits > self._last_hits:
            self.prefix_hits.inc(stats.prefix_cache_hits - self._last_hits)
            self._last_hits = stats.prefix_cache_hits
        if stats.num_preemptions > self._last_preemptions:
            self.preemptions.inc(stats.num_preemptions - self._last_preemptions)
            self._last_preemptions = stats.num_preemptions
        if self._last_queries:
            self.prefix_hit_rate.set(self._last_hits / self._last_queries)
