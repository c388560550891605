"""The table of ``/metrics``: one row per series of an engine, from which
``EngineMetrics.collect`` (``engine/metrics.py``) emits both its ``vllm:`` name and its
``asyncengine:`` alias.

A row is the series' name without its prefix, its kind, its HELP text and a getter that reads
the value off the ``EngineMetrics`` at scrape time: a number, a ``Histogram``, or, for a row with
a ``label``, a ``{label value: number}``. A getter that returns None leaves the series out of
that scrape (no KV connector configured, nothing drafted yet). The rows are in the order of
``/metrics``; the info gauges, whose labels are the information, follow them (``collect``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal


@dataclass(frozen=True, slots=True)
class Series:
    name: str
    kind: Literal["gauge", "counter", "histogram"]
    doc: str
    get: Callable[[Any], Any]  # EngineMetrics -> float | Histogram | dict[str, int] | None
    vllm: bool = True  # emitted as vllm:{name} (and vllm:{also}), labels model_name, engine
    alias: bool = True  # emitted as asyncengine:{name}, label model_name
    also: str | None = None  # a second vllm: name of the same numbers
    label: str | None = None  # one more label, after the others: get returns {its value: n}


def _hit_rate(m: Any) -> float:
    s = m.stats
    return s.prefix_cache_hits / s.prefix_cache_queries if s.prefix_cache_queries else 0.0


def _accepted_per_pos(m: Any) -> dict[str, int] | None:
    if not m.spec_num_drafts:
        return None
    return {str(pos): n for pos, n in enumerate(m.spec_accepted_per_pos)}


SERIES: tuple[Series, ...] = (
    Series("num_requests_running", "gauge", "Number of requests in model execution batches.",
           lambda m: m.stats.num_running),
    Series("num_requests_waiting", "gauge", "Number of requests waiting to be processed.",
           lambda m: m.stats.num_waiting),
    Series("kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.",
           lambda m: m.stats.kv_cache_usage),
    Series("kv_cache_free_blocks", "gauge", "KV-cache blocks free or evictable.",
           lambda m: m.stats.num_free_blocks, vllm=False),
    Series("kv_cache_total_blocks", "gauge", "KV-cache blocks in the pool.",
           lambda m: m.stats.num_total_blocks, vllm=False),
    Series("prefix_cache_hit_rate", "gauge",
           "Prefix-cache hits / queries, in tokens, since start.", _hit_rate, vllm=False),
    Series("prefix_cache_queries", "counter",
           "Prefix cache queries, in terms of number of queried tokens.",
           lambda m: m.stats.prefix_cache_queries),
    Series("prefix_cache_hits", "counter",
           "Prefix cache hits, in terms of number of cached tokens.",
           lambda m: m.stats.prefix_cache_hits),
    Series("external_prefix_cache_hits", "counter",
           "Prompt tokens loaded from the KV connector's store (computed by another engine or "
           "an earlier run) instead of computed.", lambda m: m.kv_connector_hits),
    Series("num_preemptions", "counter", "Cumulative number of preemption from the engine.",
           lambda m: m.stats.num_preemptions),
    Series("prompt_tokens", "counter",
           "Number of prefill tokens processed (computed or found in the prefix cache).",
           lambda m: m.prompt_tokens, alias=False),
    Series("prompt_tokens", "counter",
           "Prompt tokens computed by a forward pass (prefix cache hits left out).",
           lambda m: m.prompt_tokens_computed, vllm=False),
    Series("generation_tokens", "counter", "Number of generation tokens processed.",
           lambda m: m.generation_tokens),
    Series("spec_decode_num_drafts", "counter", "Number of spec decoding drafts.",
           lambda m: m.spec_num_drafts or None),
    Series("spec_decode_num_draft_tokens", "counter", "Number of draft tokens.",
           lambda m: m.spec_num_draft_tokens if m.spec_num_drafts else None),
    Series("spec_decode_num_accepted_tokens", "counter", "Number of accepted tokens.",
           lambda m: m.spec_num_accepted_tokens if m.spec_num_drafts else None),
    Series("spec_decode_num_accepted_tokens_per_pos", "counter",
           "Accepted tokens per draft position.", _accepted_per_pos, alias=False,
           label="position"),
    Series("request_success", "counter", "Count of successfully processed requests.",
           lambda m: m.success, alias=False, label="finished_reason"),
    Series("request_finished", "counter",
           "Finished requests by finish reason, aborts and failures included.",
           lambda m: m.finished, vllm=False, label="finished_reason"),
    Series("time_to_first_token_seconds", "histogram",
           "Histogram of time to first token in seconds.", lambda m: m.ttft),
    Series("inter_token_latency_seconds", "histogram",
           "Histogram of inter-token latency in seconds.", lambda m: m.itl,
           also="time_per_output_token_seconds"),
    Series("e2e_request_latency_seconds", "histogram",
           "Histogram of e2e request latency in seconds.", lambda m: m.e2e),
    Series("request_queue_time_seconds", "histogram",
           "Histogram of time spent in WAITING phase for request.", lambda m: m.queue_time,
           alias=False),
    Series("request_prefill_time_seconds", "histogram",
           "Histogram of time spent in PREFILL phase for request.", lambda m: m.prefill_time,
           alias=False),
    Series("request_decode_time_seconds", "histogram",
           "Histogram of time spent in DECODE phase for request.", lambda m: m.decode_time,
           alias=False),
    Series("request_inference_time_seconds", "histogram",
           "Histogram of time spent in RUNNING phase for request.",
           lambda m: m.inference_time, alias=False),
    Series("request_prompt_tokens", "histogram", "Number of prefill tokens processed.",
           lambda m: m.request_prompt_tokens),
    Series("request_generation_tokens", "histogram", "Number of generation tokens processed.",
           lambda m: m.request_generation_tokens),
    Series("iteration_tokens_total", "histogram",
           "Histogram of number of tokens per engine_step.", lambda m: m.iteration_tokens,
           alias=False),
)
