"""/metrics under vLLM's names, read with prometheus-client's own parser: every series vLLM's
Grafana dashboard uses is there, and after a run of known requests the numbers are those."""

from __future__ import annotations

import random
import time

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from asyncengine.config import CacheConfig
from asyncengine.core.request import Request
from asyncengine.core.sampling_params import SamplingParams
from asyncengine.core.sched.interface import SchedulerStats
from asyncengine.engine.metrics import EngineMetrics
from tests.server_utils import KEY, ServerProcess, tiny_server

#: name -> type, as vLLM's dashboard and autoscalers read them.
VLLM_METRICS = {
    "vllm:num_requests_running": "gauge", "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge", "vllm:cache_config_info": "gauge",
    "vllm:prefix_cache_queries": "counter", "vllm:prefix_cache_hits": "counter",
    "vllm:num_preemptions": "counter", "vllm:prompt_tokens": "counter",
    "vllm:generation_tokens": "counter", "vllm:request_success": "counter",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_queue_time_seconds": "histogram",
    "vllm:request_prefill_time_seconds": "histogram",
    "vllm:request_decode_time_seconds": "histogram",
    "vllm:request_prompt_tokens": "histogram", "vllm:request_generation_tokens": "histogram",
    "vllm:iteration_tokens_total": "histogram",
}


def families(text: str) -> dict[str, object]:
    return {f.name: f for f in text_string_to_metric_families(text)}


def samples(text: str) -> dict[tuple[str, frozenset], float]:
    return {(s.name, frozenset(s.labels.items())): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def value(snapshot: dict, name: str, **labels: str) -> float:
    found = [v for (n, ls), v in snapshot.items() if n == name and set(labels.items()) <= ls]
    assert len(found) == 1, (name, labels, found)
    return found[0]


# -- the collector, in-process ------------------------------------------------------------------
def test_every_vllm_metric_with_vllms_labels_and_no_created_series():
    m = EngineMetrics("m", max_model_len=1024, cache_config=CacheConfig(), num_gpu_blocks=64)
    text = m.render().decode()
    fams = families(text)
    for name, kind in VLLM_METRICS.items():
        assert fams[name].type == kind, name
    for s in fams["vllm:num_requests_running"].samples:
        assert s.labels == {"model_name": "m", "engine": "0"}
    reasons = {s.labels["finished_reason"] for s in fams["vllm:request_success"].samples}
    assert reasons == {"stop", "length", "abort"}
    info = fams["vllm:cache_config_info"].samples[0]
    assert info.value == 1 and info.labels["block_size"] == "16"
    assert info.labels["num_gpu_blocks"] == "64"
    assert not [line for line in text.splitlines() if "_created" in line]
    assert "process_resident_memory_bytes" in fams or "process_resident_memory" in fams
    assert "python_info" in fams


def test_on_token_is_one_update_whatever_the_count():
    m = EngineMetrics("m")
    m.on_token(0.02, count=10**12)  # a per-token loop would never finish
    m.on_token(3.0)
    snap = samples(m.render().decode())
    assert value(snap, "vllm:inter_token_latency_seconds_count") == 10**12 + 1
    assert value(snap, "vllm:inter_token_latency_seconds_bucket", le="0.025") == 10**12
    assert value(snap, "vllm:inter_token_latency_seconds_sum") == pytest.approx(
        0.02 * 10**12 + 3.0)


def test_request_outcomes_and_phases():
    m = EngineMetrics("m")
    r = Request("r", [1, 2, 3], SamplingParams(), arrival_time=100.0)
    r.first_scheduled_time, r.first_token_time, r.last_token_time = 100.5, 101.5, 104.0
    m.on_request_finished(4.5, "length", 3, 10, request=r)
    m.on_request_finished(1.0, "stop", 5, 2)
    m.on_request_finished(9.0, "abort", 7, 1)  # a client that left: not a success
    m.on_step(SchedulerStats(num_running=2, num_waiting=1, kv_cache_usage=0.25,
                             prefix_cache_queries=40, prefix_cache_hits=16), 24, 3)
    snap = samples(m.render().decode())
    assert value(snap, "vllm:request_success_total", finished_reason="length") == 1
    assert value(snap, "vllm:request_success_total", finished_reason="stop") == 1
    assert value(snap, "vllm:request_success_total", finished_reason="abort") == 0
    assert value(snap, "asyncengine:request_finished_total", finished_reason="abort") == 1
    assert value(snap, "vllm:e2e_request_latency_seconds_count") == 2
    assert value(snap, "vllm:request_queue_time_seconds_sum") == pytest.approx(0.5)
    assert value(snap, "vllm:request_prefill_time_seconds_sum") == pytest.approx(1.0)
    assert value(snap, "vllm:request_decode_time_seconds_sum") == pytest.approx(2.5)
    assert value(snap, "vllm:request_generation_tokens_sum") == 12
    # Prompt tokens: the 24 computed plus the 16 found in the prefix cache.
    assert value(snap, "vllm:prompt_tokens_total") == 40
    assert value(snap, "asyncengine:prompt_tokens_total") == 24
    assert value(snap, "vllm:iteration_tokens_total_sum") == 27
    assert value(snap, "vllm:num_requests_running") == 2
    assert value(snap, "vllm:num_requests_waiting") == 1
    assert value(snap, "vllm:kv_cache_usage_perc") == 0.25


# -- a known run against the real server ---------------------------------------------------------
@pytest.fixture(scope="module")
def server(tiny_llama) -> ServerProcess:
    return tiny_server(tiny_llama)


def idle(server: ServerProcess) -> dict:
    deadline = time.monotonic() + 30
    while True:
        snap = samples(server.metrics())
        if value(snap, "vllm:num_requests_running") == value(
                snap, "vllm:num_requests_waiting") == 0 or time.monotonic() > deadline:
            return snap
        time.sleep(0.1)


def test_counters_match_a_known_run(server):
    client = openai.OpenAI(base_url=server.url("/v1"), api_key=KEY, max_retries=0)
    rng = random.Random(time.time_ns())
    shared = [rng.randrange(1000, 40000) for _ in range(40)]  # fresh: no earlier cache hits
    prompts = [shared, list(shared), [rng.randrange(1000, 40000) for _ in range(7)]]
    before = idle(server)
    for p in prompts:  # one after the other: the second finds the first's blocks cached
        out = client.completions.create(prompt=p, max_tokens=4, temperature=0,
                                        model=None, extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == 4
    after = idle(server)

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    n_prompt, n_gen = sum(map(len, prompts)), 4 * len(prompts)
    assert delta("vllm:prompt_tokens_total") == n_prompt
    assert delta("vllm:generation_tokens_total") == n_gen
    assert delta("vllm:prefix_cache_queries_total") == n_prompt
    assert delta("vllm:prefix_cache_hits_total") == 32  # two full 16-token blocks
    assert delta("vllm:iteration_tokens_total_sum") == n_prompt - 32 + n_gen
    assert delta("vllm:request_success_total", finished_reason="length") == 3
    assert delta("vllm:request_success_total", finished_reason="abort") == 0
    for name in ("vllm:e2e_request_latency_seconds", "vllm:time_to_first_token_seconds",
                 "vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds",
                 "vllm:request_decode_time_seconds", "vllm:request_prompt_tokens",
                 "vllm:request_generation_tokens"):
        assert delta(name + "_count") == 3, name
    assert delta("vllm:inter_token_latency_seconds_count") == 3 * 3
    assert delta("vllm:request_prompt_tokens_sum") == n_prompt
    assert delta("vllm:request_generation_tokens_sum") == n_gen
    assert value(after, "vllm:kv_cache_usage_perc") == 0
    info = [dict(ls) for (n, ls) in after if n == "vllm:cache_config_info"][0]
    assert info["num_gpu_blocks"] == "1024" and info["block_size"] == "16"
    # The backends in use (issue 25: no silent fallback): the CPU's.
    assert value(after, "asyncengine:attention_backend_info", backend="torch_paged") == 1
    assert value(after, "asyncengine:sampling_backend_info", backend="torch") == 1
