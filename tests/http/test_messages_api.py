"""Anthropic's Messages API with the official ``anthropic`` client, against the reasoning test
server of test_reasoning.py (the tiny random llama behind a DeepSeek-R1-style template,
``--reasoning-parser deepseek_r1``, Hermes tool calls): text, streaming with Anthropic's event
sequence, stop sequences, a tool call round trip (the call forced by ``tool_choice: any``),
thinking blocks (the reasoning ended by ``budget_tokens``), count_tokens, and errors in
Anthropic's shape with the key from ``x-api-key`` or ``Authorization``."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import anthropic
import pytest

from tests.http.test_reasoning import CITIES, WEATHER, r1_server
from tests.robust_utils import assert_idle_and_free
from tests.server_utils import KEY, ServerProcess

OFF = {"type": "disabled"}
GREEDY = {"temperature": 0}  # the newest client dropped temperature: sent as vLLM accepts it
ASK = [{"role": "user", "content": "Paris or Rome?"}]
TOOLS = [{"name": "get_weather", "description": "Weather now", "input_schema": WEATHER}]


@pytest.fixture(scope="module")
def server(tiny_llama) -> ServerProcess:
    return r1_server(tiny_llama)


@pytest.fixture(scope="module")
def client(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, api_key=KEY, max_retries=0,
                               timeout=60)


@pytest.fixture(scope="module")
def model(server) -> str:
    return server.get_json("/v1/models")["data"][0]["id"]


def test_text_streamed_and_not(client, model):
    kwargs = dict(model=model, max_tokens=12, messages=ASK, system="Be brief.", extra_body=GREEDY,
                  thinking=OFF)
    msg = client.messages.create(**kwargs)
    assert msg.type == "message" and msg.role == "assistant" and msg.id.startswith("msg_")
    [block] = msg.content
    assert block.type == "text" and block.text
    assert msg.stop_reason == "max_tokens" and msg.stop_sequence is None
    assert msg.usage.output_tokens == 12
    count = client.messages.count_tokens(model=model, messages=ASK, system="Be brief.",
                                         thinking=OFF)
    assert msg.usage.input_tokens == count.input_tokens > 0
    with client.messages.stream(**kwargs) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert final.content[0].text == block.text and final.stop_reason == "max_tokens"
    assert final.usage.output_tokens == 12
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert kinds.index("content_block_start") < kinds.index("content_block_stop") < \
        kinds.index("message_delta")


def test_stop_sequence(client, model):
    whole = client.messages.create(model=model, max_tokens=12, messages=ASK, extra_body=GREEDY,
                                   thinking=OFF).content[0].text
    stop = whole[len(whole) // 2:len(whole) // 2 + 3]
    msg = client.messages.create(model=model, max_tokens=12, messages=ASK, extra_body=GREEDY,
                                 thinking=OFF, stop_sequences=[stop])
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == stop
    assert whole.startswith(msg.content[0].text) and stop not in msg.content[0].text


def test_thinking_blocks(client, model):
    kwargs = dict(model=model, max_tokens=24, messages=ASK, extra_body=GREEDY,
                  thinking={"type": "enabled", "budget_tokens": 6})
    msg = client.messages.create(**kwargs)
    assert [b.type for b in msg.content] == ["thinking", "text"]
    assert msg.content[0].thinking and "</think>" not in msg.content[0].thinking
    with client.messages.stream(**kwargs) as stream:
        thinking = "".join(e.delta.thinking for e in stream if e.type == "content_block_delta"
                           and e.delta.type == "thinking_delta")
        final = stream.get_final_message()
    assert thinking == msg.content[0].thinking
    assert [(b.type, getattr(b, "text", None)) for b in final.content] == [
        (b.type, getattr(b, "text", None)) for b in msg.content]
    # A structured output shapes the answer only, after the thinking.
    shaped = client.messages.create(**kwargs, output_config={
        "format": {"type": "json_schema", "schema": WEATHER}})
    assert [b.type for b in shaped.content] == ["thinking", "text"]
    assert json.loads(shaped.content[1].text)["city"] in CITIES
    assert shaped.stop_reason == "end_turn"


def test_tool_call_round_trip(client, model):
    kwargs = dict(model=model, max_tokens=40, messages=ASK, tools=TOOLS, extra_body=GREEDY,
                  tool_choice={"type": "any", "disable_parallel_tool_use": True}, thinking=OFF)
    msg = client.messages.create(**kwargs)
    assert msg.stop_reason == "tool_use"
    [call] = [b for b in msg.content if b.type == "tool_use"]
    assert call.name == "get_weather" and call.input["city"] in CITIES
    assert call.id.startswith("toolu_")
    with client.messages.stream(**kwargs) as stream:
        partial = "".join(e.delta.partial_json for e in stream if e.type ==
                          "content_block_delta" and e.delta.type == "input_json_delta")
        final = stream.get_final_message()
    assert json.loads(partial) == call.input
    assert [b.input for b in final.content if b.type == "tool_use"] == [call.input]
    # The result goes back; the model answers in text (tool_choice none).
    history = [*ASK, {"role": "assistant", "content": msg.content},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                             "content": "Sunny, 21 C"}]}]
    answer = client.messages.create(model=model, max_tokens=8, messages=history, tools=TOOLS,
                                    tool_choice={"type": "none"}, extra_body=GREEDY, thinking=OFF)
    assert [b.type for b in answer.content] == ["text"]
    longer = client.messages.count_tokens(model=model, messages=history, tools=TOOLS,
                                          thinking=OFF).input_tokens
    assert answer.usage.input_tokens == longer > client.messages.count_tokens(
        model=model, messages=ASK, tools=TOOLS, thinking=OFF).input_tokens


def raw(server: ServerProcess, path: str, body: dict, headers: dict) -> tuple[int, dict]:
    req = urllib.request.Request(server.url(path), data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", **headers})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_errors_in_anthropics_shape_and_both_key_headers(client, server, model):
    empty = client.messages.create(model=model, max_tokens=0, messages=ASK)  # cache warm-up
    assert empty.content == [] and empty.usage.output_tokens == 0
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=model, max_tokens=-1, messages=ASK)
    assert e.value.body["type"] == "error"
    assert e.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="claude-nope", max_tokens=4, messages=ASK)
    bad = anthropic.Anthropic(base_url=server.base_url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e:
        bad.messages.create(model=model, max_tokens=4, messages=ASK)
    assert e.value.body["error"]["type"] == "authentication_error"
    body = {"model": model, "messages": ASK}  # no max_tokens
    status, err = raw(server, "/v1/messages", body, {"x-api-key": KEY})
    assert status == 400 and err["type"] == "error" and "max_tokens" in err["error"]["message"]
    status, ok = raw(server, "/v1/messages/count_tokens", body,
                     {"Authorization": f"Bearer {KEY}"})
    assert status == 200 and ok["input_tokens"] > 0
    status, err = raw(server, "/v1/messages", {**body, "max_tokens": 4, "messages": [
        {"role": "user", "content": [{"type": "image", "source": {}}]}]}, {"x-api-key": KEY})
    assert status == 400 and err["error"]["type"] == "invalid_request_error"


def test_a_client_leaving_mid_stream_frees_the_pool(client, server, model):
    with client.messages.stream(model=model, max_tokens=64, messages=ASK, extra_body=GREEDY,
                                thinking={"type": "enabled", "budget_tokens": 6}) as stream:
        for event in stream:
            if event.type == "content_block_delta":
                break  # leave with the message unfinished
    assert_idle_and_free(server)
