"""docs/grafana/asyncengine.json reads only what ``/metrics`` serves: every metric name in its
PromQL (panels and the ``model_name`` variable) is a series ``EngineMetrics.render()`` gives
after a run, every selector is filtered by ``$model_name``, and every label it groups by
exists."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from asyncengine.config import CacheConfig
from asyncengine.core.request import Request
from asyncengine.core.sampling_params import SamplingParams
from asyncengine.core.sched.interface import SchedulerStats
from asyncengine.engine.metrics import EngineMetrics

DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana" / "asyncengine.json"
#: PromQL words that are neither metrics nor functions.
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and",
            "or", "unless", "offset"}
_NAME = re.compile(r"(?<![\w.:$])[A-Za-z_:][A-Za-z0-9_:]*")
_SELECTOR = re.compile(r"(?<![\w:])((?:vllm|asyncengine):[A-Za-z0-9_:]+)\s*(\{[^}]*\})?")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring)\s*\(([^)]*)\)")
_LABEL_VALUES = re.compile(r"^label_values\(\s*([A-Za-z_:][A-Za-z0-9_:]*)\s*(?:\{[^}]*\})?"
                           r"\s*,\s*(\w+)\s*\)$")


def served() -> tuple[set[str], set[str]]:
    """The sample names and label names of /metrics after a few requests."""
    m = EngineMetrics("m", max_model_len=1024, cache_config=CacheConfig(), num_gpu_blocks=64)
    m.on_step(SchedulerStats(num_running=1, num_waiting=1, kv_cache_usage=0.5,
                             prefix_cache_queries=16, prefix_cache_hits=8, num_preemptions=1,
                             num_free_blocks=32, num_total_blocks=64), 8, 1)
    m.on_first_token(0.05)
    m.on_token(0.02, 3)
    for reason in ("stop", "length", "abort"):
        r = Request(reason, [1, 2, 3], SamplingParams(), arrival_time=100.0)
        r.first_scheduled_time, r.first_token_time, r.last_token_time = 100.1, 100.2, 100.5
        m.on_request_finished(0.6, reason, 3, 4, request=r)
    samples = [s for f in text_string_to_metric_families(m.render().decode())
               for s in f.samples]
    return {s.name for s in samples}, {label for s in samples for label in s.labels}


def queries(node: Any) -> Iterator[tuple[str, str]]:
    """(where, PromQL) of every panel target and query variable of the dashboard."""
    if isinstance(node, dict):
        if isinstance(node.get("expr"), str):
            yield node.get("refId", "?"), node["expr"]
        for key, value in node.items():
            if key == "templating":
                for var in value["list"]:
                    query = var.get("query")
                    if var["type"] == "query":
                        yield f"${var['name']}", query["query"] if isinstance(query, dict) \
                            else query
            else:
                yield from queries(value)
    elif isinstance(node, list):
        for item in node:
            yield from queries(item)


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads."""
    if (m := _LABEL_VALUES.match(expr.strip())) is not None:
        return {m.group(1)}
    expr = re.sub(r'"(?:\\.|[^"\\])*"', '""', expr)  # strings
    expr = re.sub(r"\{[^}]*\}", "", expr)  # label matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # ranges, [$__rate_interval]
    expr = _GROUPING.sub("", expr)  # by (le), on (...)
    names = set()
    for m in _NAME.finditer(expr):
        if m.group() in KEYWORDS or expr[m.end():].lstrip().startswith("("):
            continue  # a keyword, or a function or aggregation called
        names.add(m.group())
    return names


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def test_every_metric_the_dashboard_reads_is_served(dashboard):
    names, labels = served()
    found: dict[str, set[str]] = {}
    for where, expr in queries(dashboard):
        for name in metric_names(expr):
            found.setdefault(name, set()).add(where)
        for grouping in _GROUPING.findall(expr):
            for label in filter(None, (x.strip() for x in grouping.split(","))):
                assert label in labels, f"{where}: {expr}: no series has the label {label!r}"
    missing = {n: w for n, w in found.items() if n not in names}
    assert not missing, f"not served by /metrics: {missing}"
    # What the dashboard is for: the series vLLM's dashboards chart.
    for name in ("vllm:time_to_first_token_seconds_bucket",
                 "vllm:inter_token_latency_seconds_bucket",
                 "vllm:e2e_request_latency_seconds_bucket", "vllm:prompt_tokens_total",
                 "vllm:generation_tokens_total", "vllm:num_requests_running",
                 "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total",
                 "vllm:num_preemptions_total", "vllm:request_success_total"):
        assert name in found, name


def test_every_selector_is_filtered_by_the_model_name_variable(dashboard):
    names = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert names["model_name"]["type"] == "query"
    selectors = 0
    for where, expr in queries(dashboard):
        if where.startswith("$"):
            continue
        for metric, matchers in _SELECTOR.findall(expr):
            selectors += 1
            assert 'model_name="$model_name"' in matchers, f"{where}: {metric} in {expr}"
    assert selectors >= 20


def test_the_extractor_reads_promql():
    assert metric_names('histogram_quantile(0.99, sum by(le) (rate(vllm:a_bucket{model_name='
                        '"$model_name", x=~"y"}[$__rate_interval])))') == {"vllm:a_bucket"}
    assert metric_names("rate(a_total[5m]) / on (job) group_left b + 1e9 * c offset 5m") == {
        "a_total", "b", "c"}
    assert metric_names("label_values(vllm:num_requests_running, model_name)") == {
        "vllm:num_requests_running"}
