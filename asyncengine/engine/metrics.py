"""Prometheus metrics of one engine (``GET /metrics``), under vLLM's names and meanings.

Every series a vLLM dashboard, autoscaler or router reads is here as ``vllm:*`` with vLLM's
labels (``model_name``, ``engine``) and semantics; the older ``asyncengine:*`` names are kept
as aliases of the same numbers (see docs/serving.md, "Coming from vLLM"). Which series exist,
and under which names, is the table ``SERIES`` (``engine/metrics_table.py``): one row per series
(name, kind, HELP text, getter), from which ``collect`` emits both names, then the info gauges.

The engine calls the ``on_*`` methods from its event loop, once per step or per finished
request, never per token: every update is O(1) (``on_token(itl, count)`` adds ``count``
observations of one value at once). The numbers are plain Python ints and lists; the
Prometheus families are built only when ``/metrics`` is scraped (``collect``), so nothing is
locked or allocated per step. Each ``EngineMetrics`` owns its ``CollectorRegistry`` (with the
process, platform and GC collectors), so several engines in one process never collide.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.utils import floatToGoString

from asyncengine.core.sched.interface import SchedulerStats
from asyncengine.engine.metrics_table import SERIES

if TYPE_CHECKING:
    from asyncengine.config import CacheConfig
    from asyncengine.core.request import Request

#: Finish reasons of ``vllm:request_success`` (an abort is not a success: never counted).
SUCCESS_REASONS = ("stop", "length")
FINISH_REASONS = ("stop", "length", "abort")
_FAMILIES = {"gauge": GaugeMetricFamily, "counter": CounterMetricFamily,
             "histogram": HistogramMetricFamily}

# Bucket edges as vLLM uses them.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                           50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


def buckets_1_2_5(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_value`` (vLLM's token-count buckets)."""
    out: list[int] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


class Histogram:
    """Bucket counts, a sum and a count; ``observe(value, count)`` is one bisect."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(float(b) for b in bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # the last one is +Inf
        self.sum = 0.0

    def observe(self, value: float, count: int = 1) -> None:
        """Add ``count`` observations of ``value`` (O(log buckets), whatever ``count``)."""
        self.counts[bisect_left(self.bounds, value)] += count
        self.sum += value * count

    @property
    def count(self) -> int:
        return sum(self.counts)

    def add_to(self, family: HistogramMetricFamily, labels: list[str]) -> None:
        cumulative, buckets = 0, []
        for bound, n in zip((*self.bounds, float("inf")), self.counts, strict=True):
            cumulative += n
            buckets.append((floatToGoString(bound), cumulative))
        family.add_metric(labels, buckets, sum_value=self.sum)


class EngineMetrics:
    """The numbers behind ``/metrics``; a Prometheus collector of them."""

    def __init__(self, model_name: str = "default", *, max_model_len: int = 8192,
                 cache_config: CacheConfig | None = None, num_gpu_blocks: int | None = None,
                 extra_cache_info: dict[str, Any] | None = None,
                 backends: dict[str, str] | None = None) -> None:
        self.model_name = model_name
        # {"attention": ..., "sampling": ...}: asyncengine:{kind}_backend_info{backend=...}
        self.backends = dict(backends or {})
        # Scheduler state, refreshed every step and at scrape time.
        self.stats = SchedulerStats()
        # Counters.
        self.prompt_tokens_computed = 0  # prefilled by a forward pass
        self.generation_tokens = 0
        self.finished: dict[str, int] = dict.fromkeys(FINISH_REASONS, 0)  # incl. aborts
        self.success: dict[str, int] = dict.fromkeys(FINISH_REASONS, 0)  # "abort" stays 0
        # Histograms.
        tokens = buckets_1_2_5(max_model_len)
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.e2e = Histogram(REQUEST_LATENCY_BUCKETS)
        self.queue_time = Histogram(REQUEST_LATENCY_BUCKETS)
        self.prefill_time = Histogram(REQUEST_LATENCY_BUCKETS)
        self.decode_time = Histogram(REQUEST_LATENCY_BUCKETS)
        self.inference_time = Histogram(REQUEST_LATENCY_BUCKETS)
        self.request_prompt_tokens = Histogram(tokens)
        self.request_generation_tokens = Histogram(tokens)
        self.iteration_tokens = Histogram(ITERATION_TOKEN_BUCKETS)
        self.cache_info = _cache_info(cache_config, num_gpu_blocks, extra_cache_info)
        # Speculative decoding: steps that verified drafts, drafts, accepted drafts, and
        # accepted drafts by position (0: the first draft).
        self.spec_num_drafts = 0
        self.spec_num_draft_tokens = 0
        self.spec_num_accepted_tokens = 0
        self.spec_accepted_per_pos: list[int] = []
        # Tokens a KV connector loaded instead of computing (None: no connector configured).
        self.kv_connector_hits: int | None = None
        self.lora_info: tuple[str, str, str, float] | None = None  # set_lora

        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(self)
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        GCCollector(registry=self.registry)

    # -- called by the engine (on its loop) ------------------------------------------------------
    def on_step(self, stats: SchedulerStats, num_prompt_tokens: int,
                num_generation_tokens: int) -> None:
        """After each step: the scheduler's state, the prompt tokens this step computed and the
        tokens it sampled."""
        self.stats = stats
        self.prompt_tokens_computed += num_prompt_tokens
        self.generation_tokens += num_generation_tokens
        if num_prompt_tokens or num_generation_tokens:
            self.iteration_tokens.observe(num_prompt_tokens + num_generation_tokens)

    def on_spec(self, num_draft_tokens: int, num_accepted: int) -> None:
        """One request's verified drafts in a step, and how many were accepted."""
        self.spec_num_drafts += 1
        self.spec_num_draft_tokens += num_draft_tokens
        self.spec_num_accepted_tokens += num_accepted
        per_pos = self.spec_accepted_per_pos
        if len(per_pos) < num_draft_tokens:
            per_pos += [0] * (num_draft_tokens - len(per_pos))
        for i in range(num_accepted):
            per_pos[i] += 1

    def on_first_token(self, ttft_s: float) -> None:
        self.ttft.observe(ttft_s)

    def on_token(self, itl_s: float, count: int = 1) -> None:
        """``count`` output tokens that each took ``itl_s`` (they arrived together)."""
        self.itl.observe(itl_s, count)

    def on_request_finished(self, e2e_s: float, finish_reason: str | None,
                            num_prompt_tokens: int, num_generation_tokens: int, *,
                            request: Request | None = None) -> None:
        """A request (one sample) ended. Like vLLM, only the ones that ran to a stop or to
        their length count as successes and feed the per-request histograms; aborted and
        failed ones are counted in ``asyncengine:request_finished`` alone."""
        reason = finish_reason or "abort"
        self.finished[reason] = self.finished.get(reason, 0) + 1
        if reason not in SUCCESS_REASONS:
            return
        self.success[reason] += 1
        self.e2e.observe(e2e_s)
        self.request_prompt_tokens.observe(num_prompt_tokens)
        self.request_generation_tokens.observe(num_generation_tokens)
        if request is None:
            return
        arrived, scheduled = request.arrival_time, request.first_scheduled_time
        first, last = request.first_token_time, request.last_token_time
        if scheduled is not None:
            self.queue_time.observe(scheduled - arrived)
            if first is not None:
                self.prefill_time.observe(first - scheduled)
            if last is not None:
                self.inference_time.observe(last - scheduled)
        if first is not None and last is not None:
            self.decode_time.observe(last - first)

    # -- called by the server --------------------------------------------------------------------
    def set_stats(self, stats: SchedulerStats, kv_connector_hits: int | None = None) -> None:
        """Refresh the gauges from the scheduler (at scrape time, between steps), and the
        tokens the KV connector has loaded so far when one is configured."""
        self.stats = stats
        if kv_connector_hits is not None:
            self.kv_connector_hits = kv_connector_hits

    def set_lora(self, running: list[str], waiting: list[str], max_loras: int) -> None:
        """``vllm:lora_requests_info`` (with --enable-lora): the adapters of the running and
        of the waiting requests; its value is the time of this update, as vLLM's."""
        self.lora_info = (",".join(running), ",".join(waiting), str(max_loras), time.time())

    def render(self) -> bytes:
        """The Prometheus text exposition of this registry."""
        return generate_latest(self.registry)

    # -- the collector ---------------------------------------------------------------------------
    @property
    def prompt_tokens(self) -> int:
        """vLLM's ``prompt_tokens``: every prompt token, computed or found in the prefix cache."""
        return self.prompt_tokens_computed + self.stats.prefix_cache_hits

    def collect(self) -> Iterator[Metric]:
        vllm = (["model_name", "engine"], [self.model_name, "0"])
        alias = (["model_name"], [self.model_name])
        for row in SERIES:
            value = row.get(self)
            if value is None:
                continue
            names = [("vllm:" + n, *vllm) for n in (row.name, row.also) if n and row.vllm]
            if row.alias:
                names.append(("asyncengine:" + row.name, *alias))
            extra = [row.label] if row.label else []
            for name, labels, values in names:
                family = _FAMILIES[row.kind](name, row.doc, labels=[*labels, *extra])
                if isinstance(value, Histogram):
                    value.add_to(family, values)
                elif isinstance(value, dict):
                    for key, n in value.items():
                        family.add_metric([*values, key], n)
                else:
                    family.add_metric(values, value)
                yield family
        if self.lora_info is not None:
            running, waiting, max_lora, stamp = self.lora_info
            g = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on lora requests.",
                                  labels=["max_lora", "waiting_lora_adapters",
                                          "running_lora_adapters"])
            g.add_metric([max_lora, waiting, running], stamp)
            yield g
        info = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine "
                                 "CacheConfig", labels=list(self.cache_info))
        info.add_metric(list(self.cache_info.values()), 1)
        yield info
        for kind, name in self.backends.items():
            backend = GaugeMetricFamily(f"asyncengine:{kind}_backend_info",
                                        f"The {kind} backend in use (1).", labels=["backend"])
            backend.add_metric([name], 1)
            yield backend


def _cache_info(cache: CacheConfig | None, num_gpu_blocks: int | None,
                extra: dict[str, Any] | None) -> dict[str, str]:
    """The labels of ``vllm:cache_config_info``: the cache configuration, as strings."""
    info: dict[str, Any] = {}
    if cache is not None:
        info.update((k, v) for k, v in vars(cache).items() if not k.startswith("_"))
        info.setdefault("cache_dtype", info.pop("kv_cache_dtype", "auto"))
    info["num_gpu_blocks"] = num_gpu_blocks
    info["num_cpu_blocks"] = None
    info.update(extra or {})
    info["engine"] = "0"
    return {k: str(v) for k, v in info.items()}


def render_many(sources: Sequence[EngineMetrics]) -> bytes:
    """One exposition of several engines' series (a router serving several models): each
    family once, with every engine's samples; a series with no ``model_name`` label of its own
    (the info gauges) gets its engine's. The process collectors appear once."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Merged(sources))
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
    return generate_latest(registry)


class _Merged:
    def __init__(self, sources: Sequence[EngineMetrics]) -> None:
        self.sources = sources

    def collect(self) -> Iterator[Metric]:
        merged: dict[str, Metric] = {}
        for source in self.sources:
            for family in source.collect():
                for sample in family.samples:
                    sample.labels.setdefault("model_name", source.model_name)
                seen = merged.get(family.name)
                if seen is None:
                    merged[family.name] = family
                else:
                    seen.samples.extend(family.samples)
        yield from merged.values()
