"""Replicas on Ray Serve (``asyncengine.deploy.ray``), on a local Ray cluster started here.

Two engine replicas behind the ingress serve concurrent streamed requests through the openai
client, with greedy outputs equal to one engine's; a prompt prefix computed by one replica is
loaded from the shared safetensors store by the other (its ``external_prefix_cache_hits``);
an unpinned request with that prefix is routed to the replica that holds it. The router's
table and the autoscaling policy are also checked alone, without Ray."""

from __future__ import annotations

import asyncio
import json
import os
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest
from prometheus_client.parser import text_string_to_metric_families

from asyncengine.deploy.autoscaling import WaitingQueuePolicy
from asyncengine.deploy.prefix_table import PrefixTable, routing_text

pytestmark = pytest.mark.ray

MAX_TOKENS = 8
ENGINE_FLAGS = ["--dtype", "float32", "--num-gpu-blocks-override", "128", "--max-model-len",
                "512", "--block-size", "16", "--disable-log-stats"]
WORDS = ("river stone lamp quiet orange window paper garden silver morning tower cloud "
         "bridge candle forest meadow harbor violet thunder marble").split()
#: A prefix of many blocks, shared by the store test's prompts.
SHARED = " ".join(WORDS[i * 7 % len(WORDS)] for i in range(60))
REPLICA = "X-AsyncEngine-Replica"


def distinct_prompts(n: int) -> list[str]:
    """Prompts that share no 64-character prefix (the router's chunk)."""
    return [f"{i} {WORDS[i]} " + " ".join(WORDS[(i * 3 + j) % len(WORDS)] for j in range(12))
            for i in range(n)]


# -- without Ray -------------------------------------------------------------------------------
def test_prefix_table_finds_the_replica_of_the_longest_prefix():
    t = PrefixTable(chunk_chars=8, max_entries=100)
    t.record("a" * 40, "r1")
    t.record("a" * 16 + "b" * 24, "r2")
    assert t.match("a" * 40 + "zz", {"r1", "r2"}) == ("r1", 40)
    assert t.match("a" * 16 + "b" * 8, {"r1", "r2"}) == ("r2", 24)
    assert t.match("a" * 40, {"r2"}) == ("r2", 16)  # r1 gone: r2 holds the first 16
    assert t.match("a" * 16, {"r1", "r2"}) == ("r2", 16)  # both hold it: the latest
    assert t.match("c" * 40, {"r1", "r2"}) == (None, 0)
    assert t.match("a" * 7, {"r1"}) == (None, 0)  # shorter than a chunk
    t.forget("r2")
    assert t.match("a" * 16 + "b" * 8, {"r1", "r2"}) == ("r1", 16)
    small = PrefixTable(chunk_chars=4, max_entries=3)
    small.record("x" * 40, "r1")
    assert len(small) == 3
    with pytest.raises(ValueError, match="chunk_chars"):
        PrefixTable(chunk_chars=0)


def test_routing_text_reads_prompt_messages_and_input():
    assert routing_text("/v1/completions", b'{"prompt": "hi there"}') == "hi there"
    chat = json.dumps({"messages": [{"role": "system", "content": "be brief"},
                                    {"role": "user", "content": [{"type": "text",
                                                                  "text": "hello"}]}]})
    text = routing_text("/v1/chat/completions", chat.encode())
    assert "be brief" in text and text.endswith("hello") and text.index("be brief") < 10
    assert routing_text("/v1/responses", b'{"input": "x y"}') == "x y"
    assert routing_text("/v1/models", b"") == ""
    assert routing_text("/v1/completions", b"not json") == ""
    assert routing_text("/v1/completions", b'{"prompt": [1, 2, 3]}') == "1,\x1e2,\x1e3,"


def ctx(waiting: list[float], running: list[float], current: int | None = None,
        max_num_seqs: float = 16) -> SimpleNamespace:
    n = len(waiting) if current is None else current
    return SimpleNamespace(
        current_num_replicas=n, target_num_replicas=n,
        aggregated_metrics={"num_waiting": dict(enumerate(waiting)),
                            "num_running": dict(enumerate(running)),
                            "max_num_seqs": dict.fromkeys(range(len(waiting)), max_num_seqs)})


def test_waiting_queue_policy():
    policy = WaitingQueuePolicy(target_waiting=4)
    assert policy(ctx([12, 12], [16, 16]))[0] == 6  # 12 waiting per replica, 4 wanted: x3
    assert policy(ctx([2, 1], [16, 16]))[0] == 2  # some waiting, under the target: keep
    assert policy(ctx([0, 0, 0], [3, 2, 0]))[0] == 1  # 5 running fit in one (16 at 50%)
    assert policy(ctx([0, 0], [16, 15]))[0] == 2  # busy but nobody waits: keep
    no_metrics = SimpleNamespace(current_num_replicas=2, target_num_replicas=3,
                                 aggregated_metrics={})
    assert policy(no_metrics)[0] == 3
    with pytest.raises(ValueError, match="target_waiting"):
        WaitingQueuePolicy(target_waiting=0)


def test_bad_deploy_configuration_names_the_flag(tiny_llama):
    pytest.importorskip("ray.serve")
    from asyncengine.deploy.ray import app_builder, build_app

    with pytest.raises(ValueError, match="--ssl-certfile"):
        build_app([tiny_llama, "--ssl-certfile", "cert.pem"])
    with pytest.raises(ValueError, match="--num-replicas"):
        build_app([tiny_llama], num_replicas=0)
    with pytest.raises(ValueError, match="--min-replicas"):
        build_app([tiny_llama], num_replicas=None, min_replicas=3, max_replicas=2)
    with pytest.raises(ValueError, match="--max-num-seqs"):
        build_app([tiny_llama, "--max-num-seqs", "0"])
    app = app_builder({"serve_args": f"{tiny_llama} --max-num-seqs 4", "num_replicas": "auto",
                       "min_replicas": "1", "max_replicas": "3"})
    assert type(app).__name__ == "Application"


# -- on a local Ray cluster ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def deployment(tiny_llama, tmp_path_factory):
    """Two engine replicas (autoscaling policy on, pinned at 2) sharing one KV store."""
    pytest.importorskip("ray.serve")
    import ray
    from ray import serve

    from asyncengine.deploy.ray import build_app
    from tests.server_utils import free_port

    store = tmp_path_factory.mktemp("ray-kv")
    port = free_port()
    repo = str(Path(__file__).resolve().parents[2])
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (repo, os.environ.get("PYTHONPATH")) if p)  # the replicas import this tree
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # Replicas report their engine's queues to the autoscaler every 0.5 s (Serve: 10 s).
    os.environ["RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S"] = "0.5"
    ray.init(num_cpus=4, include_dashboard=False, logging_level="warning",
             log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        app = build_app([tiny_llama, *ENGINE_FLAGS, "--kv-connector", "safetensors",
                         "--kv-connector-path", str(store)],
                        num_replicas=None, min_replicas=2, max_replicas=2,
                        replica_actor_options={"num_cpus": 1})
        serve.run(app, name="asyncengine", route_prefix="/")
        yield SimpleNamespace(url=f"http://127.0.0.1:{port}", store=store, model=tiny_llama,
                              serve=serve, build_app=build_app)
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def reference(tiny_llama):
    """One engine, the same flags, no connector: the outputs every replica must equal."""
    from asyncengine import LLM, SamplingParams

    llm = LLM(tiny_llama, dtype="float32", num_gpu_blocks_override=128, max_model_len=512,
              block_size=16)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)

    def run(prompts: list[str]) -> list[str]:
        return [o.outputs[0].text for o in llm.generate(prompts, params)]
    run.tokenize = llm.engine.tokenizer.encode
    return run


def get(url: str, path: str, replica: str) -> tuple[str, str]:
    req = urllib.request.Request(url + path, headers={REPLICA: replica})
    with urllib.request.urlopen(req, timeout=60) as r:
        return r.read().decode(), r.headers[REPLICA]


def counter(metrics_text: str, name: str, **labels: str) -> float:
    """A counter's value, summed over its other labels (0 when absent)."""
    return sum(s.value for fam in text_string_to_metric_families(metrics_text)
               for s in fam.samples if s.name in (name, name + "_total")
               and labels.items() <= s.labels.items())


def complete(url: str, prompt: str, replica: str | None = None) -> tuple[str, str]:
    """A greedy completion through the ingress; its text and the replica that served it."""
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    raw = client.completions.with_raw_response.create(
        model=client.models.list().data[0].id, prompt=prompt, max_tokens=MAX_TOKENS,
        temperature=0, extra_headers={REPLICA: replica} if replica else None)
    return raw.parse().choices[0].text, raw.headers[REPLICA]


def assert_pools_free(url: str) -> None:
    for pin in ("0", "1"):
        health = json.loads(get(url, "/health", pin)[0])
        assert health["num_free_blocks"] == health["num_total_blocks"]
        assert health["num_requests_running"] == health["num_requests_waiting"] == 0


def test_two_replicas_stream_concurrently_with_one_engines_outputs(deployment, reference):
    import openai

    prompts = distinct_prompts(8)

    async def stream_all() -> list[str]:
        client = openai.AsyncOpenAI(base_url=deployment.url + "/v1", api_key="x")
        model = (await client.models.list()).data[0].id

        async def one(prompt: str) -> str:
            chunks = []
            stream = await client.completions.create(model=model, prompt=prompt, stream=True,
                                                     max_tokens=MAX_TOKENS, temperature=0)
            async for event in stream:
                chunks.append(event.choices[0].text)
            assert len(chunks) > 1  # streamed, not one body
            return "".join(chunks)
        try:
            return await asyncio.gather(*(one(p) for p in prompts))
        finally:
            await client.close()

    before = [counter(get(deployment.url, "/metrics", pin)[0], "vllm:request_success")
              for pin in ("0", "1")]
    assert asyncio.run(stream_all()) == reference(prompts)
    served = [counter(get(deployment.url, "/metrics", pin)[0], "vllm:request_success") - b
              for pin, b in zip(("0", "1"), before, strict=True)]
    assert sum(served) == len(prompts) and min(served) > 0, served  # both replicas served
    assert_pools_free(deployment.url)


def test_a_prefix_computed_on_one_replica_is_loaded_by_the_other(deployment, reference):
    url = deployment.url
    hits = "vllm:external_prefix_cache_hits"
    first, second, third = (SHARED + tail for tail in (" alpha", " beta", " gamma"))
    text0, id0 = complete(url, first, replica="0")
    _, id1 = get(url, "/health", "1")
    assert id0 != id1
    loaded_before = counter(get(url, "/metrics", "1")[0], hits)
    wait_for_saves(deployment.store)
    # The other replica has never seen the prefix: it loads it from the store.
    text1, served = complete(url, second, replica="1")
    assert served == id1
    loaded = counter(get(url, "/metrics", "1")[0], hits) - loaded_before
    a, b = reference.tokenize(first), reference.tokenize(second)
    common = next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
    assert loaded == common // 16 * 16 > 0, (loaded, common)  # the shared whole blocks
    assert counter(get(url, "/metrics", "0")[0], hits) == 0  # replica 0 computed it
    # Unpinned, the same prefix goes where it was last served, and hits the local cache.
    local_before = counter(get(url, "/metrics", "1")[0], "vllm:prefix_cache_hits")
    text2, routed = complete(url, third)
    assert routed == id1
    assert counter(get(url, "/metrics", "1")[0], "vllm:prefix_cache_hits") > local_before
    assert [text0, text1, text2] == reference([first, second, third])
    assert_pools_free(url)


def wait_for_saves(store: Path, timeout: float = 30.0) -> None:
    """Saves run in the background after the step: wait until the block files stop coming."""
    deadline = time.monotonic() + timeout
    seen = -1
    while time.monotonic() < deadline:
        n = len(list(store.rglob("*.safetensors")))
        if n and n == seen:
            return
        seen = n
        time.sleep(0.5)
    raise AssertionError(f"the store at {store} got no blocks in {timeout}s")


def test_errors_pass_through_and_a_client_that_leaves_frees_its_blocks(deployment):
    import httpx
    import openai

    client = openai.OpenAI(base_url=deployment.url + "/v1", api_key="x", max_retries=0)
    model = client.models.list().data[0].id
    with pytest.raises(openai.BadRequestError) as e:  # the replica's own 400, unchanged
        client.completions.create(model=model, prompt="hi", max_tokens=-1)
    assert e.value.body["param"] == "max_tokens" or "max_tokens" in str(e.value)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="hi", max_tokens=4)
    # A streamed request abandoned after two events is aborted on its replica.
    aborted = "asyncengine:request_finished"
    before = [counter(get(deployment.url, "/metrics", pin)[0], aborted, finished_reason="abort")
              for pin in ("0", "1")]
    body = {"model": model, "prompt": "a long story", "max_tokens": 400, "stream": True,
            "ignore_eos": True, "temperature": 0}
    for pin in ("0", "1"):
        with httpx.stream("POST", deployment.url + "/v1/completions", json=body,
                          headers={REPLICA: pin}, timeout=60) as r:
            assert r.status_code == 200
            events = r.iter_lines()
            assert [next(events) for _ in range(3)][0].startswith("data: ")
    deadline = time.monotonic() + 30
    while True:
        try:
            assert_pools_free(deployment.url)
            break
        except (AssertionError, urllib.error.HTTPError) as e:
            # a 503 (with Retry-After) while the replica winds the streams down is "not yet";
            # an engine that stopped keeps answering 503 past the deadline
            if time.monotonic() > deadline or (
                    isinstance(e, urllib.error.HTTPError) and e.code != 503):
                raise
            time.sleep(0.2)
    after = [counter(get(deployment.url, "/metrics", pin)[0], aborted, finished_reason="abort")
             for pin in ("0", "1")]
    assert [a - b for a, b in zip(after, before, strict=True)] == [1, 1]


def test_a_waiting_queue_scales_the_deployment_up(deployment):
    """One replica with one batch slot; twelve requests queue on it: the policy asks for
    more replicas (capped at two) and Serve starts the second. Under a route prefix."""
    import httpx

    serve = deployment.serve
    app = deployment.build_app(
        [deployment.model, *ENGINE_FLAGS, "--max-num-seqs", "1"], num_replicas=None,
        min_replicas=1, max_replicas=2, target_waiting=2,
        replica_actor_options={"num_cpus": 1},
        autoscaling_kwargs={"upscale_delay_s": 0, "downscale_delay_s": 600,
                            "metrics_interval_s": 0.5, "look_back_period_s": 2})
    serve.run(app, name="scaling", route_prefix="/scaling")
    url = deployment.url + "/scaling"

    def running() -> int:
        states = serve.status().applications["scaling"].deployments["AsyncEngine"]
        return states.replica_states.get("RUNNING", 0)

    try:
        assert running() == 1
        body = {"model": deployment.model, "prompt": "once upon a time", "max_tokens": 400,
                "ignore_eos": True, "temperature": 0, "stream": True}

        async def flood() -> None:
            async with httpx.AsyncClient(base_url=url, timeout=120) as client:
                async def one() -> None:
                    async with client.stream("POST", "/v1/completions", json=body) as r:
                        assert r.status_code == 200
                        async for _ in r.aiter_bytes():
                            pass

                tasks = [asyncio.ensure_future(one()) for _ in range(12)]
                deadline = time.monotonic() + 90
                while running() < 2:
                    assert time.monotonic() < deadline, "never scaled up"
                    assert not any(t.done() and t.exception() for t in tasks)
                    await asyncio.sleep(0.5)
                for t in tasks:  # the clients leave: their requests are aborted
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run(flood())
        assert running() == 2
        deadline = time.monotonic() + 30
        for pin in ("0", "1"):
            while True:
                health = json.loads(get(url, "/health", pin)[0])
                if health["num_free_blocks"] == health["num_total_blocks"]:
                    break
                assert time.monotonic() < deadline, health
                time.sleep(0.2)
    finally:
        serve.delete("scaling")
