"""The limits of a request without HTTP: SamplingParams refuses what the kernels cannot hold
(the offline API's ValueError names the parameter), the engine adds the server's limits and
refuses requests past --max-queued-requests, and /openapi.json publishes the same ranges."""

from __future__ import annotations

import math

import anyio
import pytest
from aiohttp import web

from asyncengine import SamplingParams
from asyncengine.config import EngineConfig
from asyncengine.core.limits import SamplingLimits
from asyncengine.core.sampling_params import StructuredOutputsParams
from asyncengine.engine.engine import AsyncEngine, EngineOverloaded
from asyncengine.entrypoints.http.app import BUILTIN_ROUTES
from asyncengine.entrypoints.http.openapi import build_openapi


@pytest.mark.parametrize("kwargs, param", [
    ({"temperature": math.nan}, "temperature"),
    ({"temperature": math.inf}, "temperature"),
    ({"temperature": 1e39}, "temperature"),
    ({"temperature": 10**400}, "temperature"),
    ({"top_p": math.nan}, "top_p"),
    ({"min_p": -0.1}, "min_p"),
    ({"presence_penalty": math.inf}, "presence_penalty"),
    ({"frequency_penalty": -math.inf}, "frequency_penalty"),
    ({"repetition_penalty": 1e-50}, "repetition_penalty"),
    ({"repetition_penalty": math.nan}, "repetition_penalty"),
    ({"seed": 2**64}, "seed"),
    ({"seed": -(2**63) - 1}, "seed"),
    ({"seed": 2**63 - 1, "n": 2}, "seed"),
    ({"top_k": 2**63}, "top_k"),
    ({"top_k": -5}, "top_k"),
    ({"logit_bias": {5: math.nan}}, "logit_bias"),
    ({"logit_bias": {-1: 1.0}}, "logit_bias"),
    ({"max_tokens": 2**64}, "max_tokens"),
    ({"logprobs": -1}, "logprobs"),
])
def test_sampling_params_refuse_values_the_kernels_cannot_hold(kwargs, param):
    with pytest.raises(ValueError) as e:
        SamplingParams(**kwargs)
    assert str(e.value).startswith(param)


def test_sampling_params_accept_the_edges():
    SamplingParams(temperature=1e4, top_p=1e-300, repetition_penalty=0.01, seed=-(2**63),
                   top_k=-1, logit_bias={"7": -100, 8: 100}, presence_penalty=2)
    SamplingParams(seed=2**63 - 4, n=4, repetition_penalty=100, top_k=10**12)


def test_deep_schemas_are_refused():
    deep = {"type": "integer"}
    for _ in range(70):
        deep = {"type": "array", "items": deep}
    with pytest.raises(ValueError, match="64 levels"):
        StructuredOutputsParams(json=deep)
    text = '{"type": "array", "items": ' * 5000 + "{}" + "}" * 5000
    with pytest.raises(ValueError, match="64 levels"):
        StructuredOutputsParams(json=text)


def test_engine_applies_the_server_limits_and_refuses_past_the_queue(tiny_llama):
    config = EngineConfig.from_dict(dict(
        model=tiny_llama, max_n=4, max_logprobs=3, max_queued_requests=2, max_num_seqs=1,
        max_model_len=128, num_gpu_blocks_override=32))
    engine = AsyncEngine(config)
    vocab = engine.vocab_size

    async def main():
        async with engine:
            for params, param in ((SamplingParams(n=5), "n"),
                                  (SamplingParams(logprobs=4), "logprobs"),
                                  (SamplingParams(prompt_logprobs=4), "prompt_logprobs"),
                                  (SamplingParams(logit_bias={vocab: 1.0}), "logit_bias")):
                with pytest.raises(ValueError) as e:
                    await engine.add_request([5, 6], params)
                assert str(e.value).startswith(param), e.value
            # Nothing runs until the loop gets a turn: these two wait, the third is refused.
            streams = [await engine.add_request([5, 6], SamplingParams(max_tokens=2))
                       for _ in range(2)]
            with pytest.raises(EngineOverloaded, match="--max-queued-requests 2"):
                await engine.add_request([5, 6], SamplingParams(max_tokens=2))
            for s in streams:
                async for _ in s:
                    pass
            # The queue emptied: accepted again.
            outs = [out async for out in engine.generate(
                [5, 6], SamplingParams(max_tokens=2, n=4, logprobs=3))]
            assert outs[-1].finished and len(outs[-1].outputs) == 4
            assert engine.num_free_blocks == engine.num_total_blocks

    anyio.run(main)


def test_openapi_publishes_the_ranges_and_the_event_stream():
    doc = build_openapi(BUILTIN_ROUTES, web.Application(), version="0", secured=False,
                        limits=SamplingLimits(max_n=7, max_logprobs=3))
    schemas = doc["components"]["schemas"]

    def number(body: str, name: str) -> dict:
        return next(o for o in schemas[body]["properties"][name]["anyOf"] if o["type"] != "null")

    assert doc["openapi"] == "3.2.0"
    for body in ("CompletionRequest", "ChatCompletionRequest"):
        assert number(body, "temperature") == {"type": "number", "minimum": 0,
                                               "maximum": 10000}
        assert number(body, "top_p")["exclusiveMinimum"] == 0
        assert number(body, "repetition_penalty")["minimum"] == 0.01
        assert number(body, "n")["maximum"] == 7
        assert number(body, "seed")["maximum"] == 2**63 - 1
        assert number(body, "top_k")["minimum"] == -1 and "maximum" not in number(body,
                                                                                  "top_k")
        assert number(body, "logit_bias")["additionalProperties"] == {
            "type": "number", "minimum": -100, "maximum": 100}
    assert number("CompletionRequest", "logprobs")["maximum"] == 3
    assert number("ChatCompletionRequest", "top_logprobs")["maximum"] == 3
    post = doc["paths"]["/v1/chat/completions"]["post"]
    sse = post["responses"]["200"]["content"]["text/event-stream"]["itemSchema"]
    data = sse["properties"]["data"]
    assert data["if"] == {"const": "[DONE]"}
    assert data["else"]["contentMediaType"] == "application/json"
    assert {"$ref": "#/components/schemas/ChatCompletionChunk"} in data["else"][
        "contentSchema"]["anyOf"]
    assert post["responses"]["503"]["headers"]["Retry-After"]["required"] is True
    assert "503" not in doc["paths"]["/metrics"]["get"]["responses"]
