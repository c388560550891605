"""The OpenAI-compatible server, driven by the official openai client and a raw SSE client;
greedy outputs are compared with the engine's own (``LLM``, in-process, same model)."""

from __future__ import annotations

import http.client
import json
import re

import aiohttp
import anyio
import openai
import pytest

from asyncengine.core.sampling_params import SamplingParams, StructuredOutputsParams
from tests.server_utils import KEY, ServerProcess, sse_events, tiny_server

PROMPTS = ["The quick brown fox", "Once upon a time, in a land far away"]
CHAT = [{"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name three colors."}]


@pytest.fixture(scope="module")
def server(tiny_llama) -> ServerProcess:
    return tiny_server(tiny_llama)


@pytest.fixture(scope="module")
def reference(tiny_llama):
    from asyncengine.engine.llm import LLM

    return LLM(tiny_llama, num_gpu_blocks_override=256)


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url("/v1"), api_key=KEY, max_retries=0,
                         timeout=60)


@pytest.fixture(scope="module")
def model(server) -> str:
    return server.get_json("/v1/models")["data"][0]["id"]


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0, **kw)


def test_models_health_version_openapi(server, client, model, tiny_llama):
    assert [m.id for m in client.models.list().data] == [model]
    card = client.models.retrieve(model)
    assert card.id == model and card.owned_by == "asyncengine"
    health = server.get_json("/health")
    assert health["status"] == "ok"
    assert health["num_free_blocks"] == health["num_total_blocks"] > 0
    assert re.fullmatch(r"\d+\.\d+\.\d+.*", server.get_json("/version")["version"])
    doc = server.get_json("/openapi.json")
    paths = doc["paths"]
    for path, method in [("/v1/completions", "post"), ("/v1/chat/completions", "post"),
                         ("/v1/models", "get"), ("/health", "get"), ("/metrics", "get"),
                         ("/tokenize", "post"), ("/detokenize", "post"), ("/version", "get"),
                         ("/openapi.json", "get"), ("/v1/models/{model}", "get"),
                         ("/v1/responses", "post"), ("/v1/embeddings", "post"),
                         ("/ping", "get"), ("/ping", "post")]:
        assert method in paths[path], path
    body = paths["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]
    schema = doc["components"]["schemas"][body["schema"]["$ref"].rsplit("/", 1)[1]]
    assert {"prompt", "max_tokens", "logprobs", "echo", "structured_outputs",
            "response_format"} <= set(schema["properties"])
    assert schema["required"] == ["prompt"]
    # Unknown fields are accepted and ignored (as OpenAI's and vLLM's servers do).
    assert schema.get("additionalProperties", True) is not False


def test_completions_equal_engine_outputs(client, model, reference):
    for prompt in PROMPTS:
        ref = reference.generate(prompt, greedy(max_tokens=12))[0]
        out = client.completions.create(model=model, prompt=prompt, max_tokens=12,
                                        temperature=0)
        assert out.id.startswith("cmpl-") and out.object == "text_completion"
        assert out.choices[0].text == ref.outputs[0].text
        assert out.choices[0].finish_reason == ref.outputs[0].finish_reason
        assert out.usage.prompt_tokens == len(ref.prompt_token_ids)
        assert out.usage.completion_tokens == len(ref.outputs[0].token_ids)
        stream = client.completions.create(model=model, prompt=prompt, max_tokens=12,
                                           temperature=0, stream=True)
        chunks = list(stream)
        assert "".join(c.choices[0].text for c in chunks) == ref.outputs[0].text
        assert chunks[-1].choices[0].finish_reason == ref.outputs[0].finish_reason
        assert all(c.id == chunks[0].id for c in chunks)


def test_chat_equals_engine_outputs(client, model, reference):
    ref = reference.chat(CHAT, greedy(max_tokens=16))[0]
    out = client.chat.completions.create(model=model, messages=CHAT, max_tokens=16,
                                         temperature=0)
    assert out.id.startswith("chatcmpl-") and out.object == "chat.completion"
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == ref.outputs[0].text
    assert out.usage.prompt_tokens == len(ref.prompt_token_ids)
    stream = client.chat.completions.create(
        model=model, messages=CHAT, max_completion_tokens=16, temperature=0, stream=True,
        stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ref.outputs[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16
    assert chunks[-2].choices[0].finish_reason == "length"


def test_n_and_several_prompts(client, model, reference):
    out = client.completions.create(model=model, prompt=PROMPTS, n=2, max_tokens=5,
                                    temperature=0)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    for i, prompt in enumerate(PROMPTS):
        ref = reference.generate(prompt, greedy(max_tokens=5))[0].outputs[0].text
        assert out.choices[2 * i].text == out.choices[2 * i + 1].text == ref
    assert out.usage.completion_tokens == 20
    # Token-id prompts, sampled: four streamed choices, each finished once.
    ids = [reference.tokenizer.encode(p) for p in PROMPTS]
    stream = client.completions.create(model=model, prompt=ids, n=2, max_tokens=6,
                                       temperature=1.0, seed=7, stream=True)
    finished: dict[int, str] = {}
    for chunk in stream:
        for c in chunk.choices:
            assert c.index not in finished
            if c.finish_reason:
                finished[c.index] = c.finish_reason
    assert finished == {0: "length", 1: "length", 2: "length", 3: "length"}
    chat = client.chat.completions.create(model=model, messages=CHAT, n=3, max_tokens=4,
                                          temperature=1.0, seed=3)
    assert sorted(c.index for c in chat.choices) == [0, 1, 2]
    assert chat.usage.completion_tokens == 12


def test_completion_logprobs(client, model, reference):
    ref = reference.generate(PROMPTS[0], greedy(max_tokens=8, logprobs=3))[0].outputs[0]
    out = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=8,
                                    temperature=0, logprobs=3)
    lp = out.choices[0].logprobs
    assert "".join(lp.tokens) == out.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(8)]
    for i, (token, token_id) in enumerate(zip(lp.tokens, ref.token_ids, strict=True)):
        assert lp.token_logprobs[i] == pytest.approx(ref.logprobs[i][token_id].logprob,
                                                     abs=1e-4)
        assert token in lp.top_logprobs[i] and 3 <= len(lp.top_logprobs[i]) <= 4
        assert max(lp.top_logprobs[i].values()) == pytest.approx(lp.token_logprobs[i])
    chunks = list(client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=8,
                                            temperature=0, logprobs=1, stream=True))
    streamed = [t for c in chunks for t in c.choices[0].logprobs.tokens]
    assert streamed == lp.tokens


def test_echo_with_prompt_logprobs(client, model, reference):
    prompt = PROMPTS[1]
    ids = reference.tokenizer.encode(prompt)
    out = client.completions.create(model=model, prompt=prompt, max_tokens=3,
                                    temperature=0, echo=True, logprobs=1)
    choice = out.choices[0]
    assert choice.text.startswith(prompt) and len(choice.text) > len(prompt)
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids) + 3
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for i in range(1, len(ids) + 3):  # each prompt token is scored given the ones before
        assert lp.tokens[i] in lp.top_logprobs[i]
        assert lp.token_logprobs[i] == lp.top_logprobs[i][lp.tokens[i]] <= 0


def test_chat_logprobs(client, model):
    out = client.chat.completions.create(model=model, messages=CHAT, max_tokens=6,
                                         temperature=0, logprobs=True, top_logprobs=2)
    content = out.choices[0].logprobs.content
    assert "".join(e.token for e in content) == out.choices[0].message.content
    for e in content:
        assert e.bytes == list(e.token.encode())
        assert len(e.top_logprobs) == 2
        assert e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob
        assert e.top_logprobs[0].token == e.token  # greedy picks the top token
        assert e.logprob == pytest.approx(e.top_logprobs[0].logprob)


def test_stop_strings(client, model):
    full = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=16,
                                     temperature=0).choices[0].text
    stop = full[len(full) // 2: len(full) // 2 + 3]
    cut = full[:full.index(stop)]
    out = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=16,
                                    temperature=0, stop=[stop, "\u2603never"])
    assert out.choices[0].text == cut
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].model_extra["stop_reason"] == stop
    kept = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=16,
                                     temperature=0, stop=stop,
                                     extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].text == cut + stop
    streamed = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=16,
                                         temperature=0, stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == cut


def test_structured_outputs(client, model, reference):
    out = client.completions.create(model=model, prompt="Answer:", max_tokens=10,
                                    temperature=0,
                                    extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert out.choices[0].text in ("yes", "no") and out.choices[0].finish_reason == "stop"
    ref = reference.generate("Answer:", greedy(max_tokens=10, structured_outputs=(
        StructuredOutputsParams(choice=["yes", "no"]))))[0]
    assert out.choices[0].text == ref.outputs[0].text
    out = client.completions.create(model=model, prompt="Code:", max_tokens=10, temperature=0,
                                    extra_body={"structured_outputs": {"regex": "[0-9]{3}"}})
    assert re.fullmatch(r"[0-9]{3}", out.choices[0].text)
    schema = {"type": "object", "properties": {"color": {"enum": ["red", "green"]}},
              "required": ["color"], "additionalProperties": False}
    chat = client.chat.completions.create(
        model=model, messages=CHAT, max_tokens=40, temperature=0,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "c", "schema": schema, "strict": True}})
    if chat.choices[0].finish_reason == "stop":
        assert json.loads(chat.choices[0].message.content)["color"] in ("red", "green")
    else:  # a random model may pad with whitespace: what it wrote is still a valid prefix
        assert chat.choices[0].message.content.lstrip().startswith("{")


def test_raw_sse_client(server, model):
    async def main():
        body = {"model": model, "messages": CHAT, "max_tokens": 5, "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True}}
        async with aiohttp.ClientSession(headers=server.headers()) as session, \
                session.post(server.url("/v1/chat/completions"), json=body) as resp:
            assert resp.status == 200
            assert resp.headers["Content-Type"].startswith("text/event-stream")
            return await resp.read()

    events = sse_events(anyio.run(main))
    assert events[-1] == "[DONE]"
    first, *middle, usage, _ = events
    assert first["object"] == "chat.completion.chunk" and first["id"].startswith("chatcmpl-")
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert middle[-1]["choices"][0]["finish_reason"] == "length"
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 5
    assert usage["usage"]["total_tokens"] == usage["usage"]["prompt_tokens"] + 5


def test_keep_alive_connection_is_reused(server, model):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    sockets = []
    for stream in (True, False, True):
        body = json.dumps({"model": model, "prompt": "Hi", "max_tokens": 3, "stream": stream})
        conn.request("POST", "/v1/completions", body,
                     {"Content-Type": "application/json", **server.headers()})
        resp = conn.getresponse()
        data = resp.read()
        assert resp.status == 200, data
        assert resp.getheader("Connection", "keep-alive").lower() != "close"
        sockets.append(conn.sock)
    assert sockets[0] is not None and all(s is sockets[0] for s in sockets)
    conn.close()


def test_tokenize_detokenize(server, client, model, reference):
    import urllib.request

    def post(path, body):
        req = urllib.request.Request(server.url(path), json.dumps(body).encode(),
                                     {"Content-Type": "application/json", **server.headers()})
        with urllib.request.urlopen(req) as r:
            return json.loads(r.read())

    tok = post("/tokenize", {"model": model, "prompt": PROMPTS[1], "return_token_strs": True})
    assert tok["tokens"] == reference.tokenizer.encode(PROMPTS[1])
    assert tok["count"] == len(tok["tokens"]) == len(tok["token_strs"])
    assert post("/detokenize", {"tokens": tok["tokens"]})["prompt"] == PROMPTS[1]
    chat_tok = post("/tokenize", {"messages": CHAT})
    usage = client.chat.completions.create(model=model, messages=CHAT, max_tokens=1).usage
    assert chat_tok["count"] == usage.prompt_tokens
