"""A vLLM user's client code against the real server, with the official openai client: tool
calls ("required", a named function, "auto"; streamed and not), a history of tool results,
the Responses API, embeddings, and requests carrying fields this server does not use.

The tiny random model writes gibberish, so calls are forced: "required" and named functions
by their grammar, "auto" by a regex that makes the model write a Hermes tool call the
server's parser then reads."""

from __future__ import annotations

import json
from collections import defaultdict

import jsonschema
import numpy as np
import openai
import pytest

from tests.server_utils import KEY, TOOLS_SERVER_NAMES, ServerProcess, tools_server

WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]},
                                            "unit": {"enum": ["C", "F"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
HERMES_CALL = (r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)", '
               r'"unit": "C"\}\}\n</tool_call>')


@pytest.fixture(scope="module")
def server(tiny_llama) -> ServerProcess:
    return tools_server(tiny_llama)


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url("/v1"), api_key=KEY, max_retries=0, timeout=60)


MODEL = TOOLS_SERVER_NAMES[0]


def check_calls(calls) -> list[tuple[str, dict]]:
    """(name, arguments) of each call, its arguments validated against the tool's schema."""
    out = []
    for call in calls:
        assert call.type == "function" and call.id
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, SCHEMAS[call.function.name])
        out.append((call.function.name, args))
    return out


def merged_stream(stream) -> tuple[str, dict[int, dict], str | None]:
    """Content, tool calls merged by index (as the openai SDK's helpers do), finish reason."""
    content, calls, finish = "", defaultdict(lambda: {"name": "", "arguments": ""}), None
    for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for tc in choice.delta.tool_calls or []:
                entry = calls[tc.index]
                if tc.id:
                    assert "id" not in entry, "the id comes once, on the call's first piece"
                    entry["id"] = tc.id
                    assert tc.type == "function" and tc.function.name
                entry["name"] += tc.function.name or ""
                entry["arguments"] += tc.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, dict(calls), finish


def test_required_tool_choice(client):
    out = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                         tool_choice="required", parallel_tool_calls=False,
                                         max_tokens=64, temperature=0)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert len(check_calls(choice.message.tool_calls)) == 1
    content, calls, finish = merged_stream(client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
        parallel_tool_calls=False, max_tokens=64, temperature=0, stream=True))
    assert finish == "tool_calls" and content == "" and list(calls) == [0]
    streamed = calls[0]
    first = choice.message.tool_calls[0].function
    assert (streamed["name"], streamed["arguments"]) == (first.name, first.arguments)


def test_named_tool_choice(client):
    named = {"type": "function", "function": {"name": "get_time"}}
    out = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                         tool_choice=named, max_tokens=64, temperature=0.8,
                                         seed=1)
    assert out.choices[0].finish_reason == "tool_calls"
    assert out.choices[0].message.content is None
    [(name, args)] = check_calls(out.choices[0].message.tool_calls)
    assert name == "get_time"
    _, calls, finish = merged_stream(client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice=named, max_tokens=64,
        temperature=0.8, seed=1, stream=True))
    assert finish == "tool_calls"
    assert calls[0]["name"] == "get_time" and json.loads(calls[0]["arguments"]) == args


def test_auto_tool_choice_parses_the_models_output(client):
    forced = {"structured_outputs": {"regex": HERMES_CALL}}
    out = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                         tool_choice="auto", max_tokens=80, temperature=0,
                                         extra_body=forced)
    msg = out.choices[0].message
    assert out.choices[0].finish_reason == "tool_calls" and not msg.content
    [(name, args)] = check_calls(msg.tool_calls)
    assert name == "get_weather" and args["unit"] == "C"
    content, calls, finish = merged_stream(client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, max_tokens=80, temperature=0,
        extra_body=forced, stream=True))
    assert finish == "tool_calls" and content == ""
    assert json.loads(calls[0]["arguments"]) == args
    # No call in the output: plain content, no tool_calls.
    plain = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                           max_tokens=6, temperature=0)
    assert plain.choices[0].message.tool_calls is None
    assert plain.choices[0].message.content and plain.choices[0].finish_reason == "length"


def test_a_history_with_tool_calls_and_results(server, client):
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "C"}'}}
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]},
               {"role": "tool", "tool_call_id": "call_1", "content": "-3 degrees, snow"}]
    import urllib.request

    req = urllib.request.Request(
        server.url("/tokenize"), json.dumps({"messages": history, "tools": TOOLS}).encode(),
        {"Content-Type": "application/json", **server.headers()})
    with urllib.request.urlopen(req) as r:
        ids = json.loads(r.read())["tokens"]
    req = urllib.request.Request(server.url("/detokenize"), json.dumps({"tokens": ids}).encode(),
                                 {"Content-Type": "application/json", **server.headers()})
    with urllib.request.urlopen(req) as r:
        prompt = json.loads(r.read())["prompt"]
    # The template saw the tools, the call (arguments as an object) and its result.
    assert '"name": "get_time"' in prompt
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "C"}}' \
        in prompt
    assert "<tool_response>\n-3 degrees, snow\n</tool_response>" in prompt
    out = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS,
                                         tool_choice="required", parallel_tool_calls=False,
                                         max_tokens=64, temperature=0)
    assert out.usage.prompt_tokens == len(ids)
    check_calls(out.choices[0].message.tool_calls)


def test_tool_requests_that_cannot_work_are_400s(client):
    cases = [
        (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}),
         "tool_choice"),
        (dict(tool_choice="required"), "tool_choice"),
        (dict(tools=TOOLS, tool_choice="required",
              response_format={"type": "json_object"}), "tool_choice"),
        (dict(messages=[{"role": "user", "content": "x", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]),
         "messages[0].tool_calls"),
    ]
    for kwargs, param in cases:
        kwargs = {"messages": ASK, **kwargs}
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, max_tokens=4, **kwargs)
        assert e.value.body["param"] == param


def test_responses_api(client):
    out = client.responses.create(model=MODEL, input="Say something.", instructions="Be terse.",
                                  max_output_tokens=6, temperature=0)
    assert out.object == "response" and out.id.startswith("resp")
    assert out.status == "incomplete" and out.incomplete_details.reason == "max_output_tokens"
    assert out.usage.output_tokens == 6 and out.output_text
    assert out.output[0].type == "message" and out.output[0].role == "assistant"
    events = list(client.responses.create(model=MODEL, input=[
        {"role": "developer", "content": "Be terse."},
        {"role": "user", "content": [{"type": "input_text", "text": "Say something."}]}],
        max_output_tokens=6, temperature=0, stream=True))
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == out.output_text  # same prompt (instructions = developer), greedy
    assert events[-1].response.output_text == text
    # the same prompt a second time: its tokens found in the prefix cache, as usage says
    usage = events[-1].response.usage
    assert 0 < usage.input_tokens_details.cached_tokens < usage.input_tokens


def test_responses_api_function_tools(client):
    tools = [{"type": "function", "name": "get_weather", "parameters": WEATHER},
             {"type": "function", "name": "get_time", "parameters": TIME}]
    history = [{"role": "user", "content": "Weather in Rome?"},
               {"type": "function_call", "call_id": "c1", "name": "get_weather",
                "arguments": '{"city": "Rome", "unit": "F"}'},
               {"type": "function_call_output", "call_id": "c1", "output": "75 degrees"}]
    out = client.responses.create(model=MODEL, input=history, tools=tools,
                                  tool_choice="required", parallel_tool_calls=False,
                                  max_output_tokens=64)
    [call] = out.output
    assert call.type == "function_call" and call.call_id
    jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    events = list(client.responses.create(
        model=MODEL, input="What time is it?", tools=tools, max_output_tokens=64,
        tool_choice={"type": "function", "name": "get_time"}, stream=True))
    deltas = "".join(e.delta for e in events
                     if e.type == "response.function_call_arguments.delta")
    [done] = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert done.arguments == deltas and json.loads(deltas)["tz"] in ("UTC", "CET")
    final = events[-1].response
    assert [(o.type, o.name, o.arguments) for o in final.output] == [
        ("function_call", "get_time", deltas)]


def test_embeddings_are_the_models_last_hidden_state(client, tiny_llama):
    import torch

    from tests.utils import hf_reference_model

    texts = ["The quick brown fox", "jumps"]
    out = client.embeddings.create(model=MODEL, input=texts)  # base64 on the wire
    assert [d.index for d in out.data] == [0, 1]
    vectors = np.array([d.embedding for d in out.data])
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1, atol=1e-5)
    ref_model = hf_reference_model(tiny_llama)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama)
    for text, vector in zip(texts, vectors, strict=True):
        ids = tok(text, return_tensors="pt").input_ids
        with torch.no_grad():
            last = ref_model.model(ids).last_hidden_state[0, -1]
        ref = torch.nn.functional.normalize(last, dim=0).numpy()
        assert np.abs(vector - ref).max() < 1e-4
    single = client.embeddings.create(model=TOOLS_SERVER_NAMES[1], input=texts[1],
                                      encoding_format="float")
    assert np.abs(np.array(single.data[0].embedding) - vectors[1]).max() < 1e-5
    ids = tok(texts[0]).input_ids
    by_ids = client.embeddings.create(model=MODEL, input=[ids])
    assert np.abs(np.array(by_ids.data[0].embedding) - vectors[0]).max() < 1e-5
    assert out.usage.prompt_tokens == len(ids) + len(tok(texts[1]).input_ids)
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model=MODEL, input="x", dimensions=3)
    assert e.value.body["param"] == "dimensions"


def test_extra_fields_are_accepted_and_logged_once(server, client):
    for _ in range(2):
        out = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi", "cache_hint": 1}],
            max_tokens=3, metadata={"team": "a"}, service_tier="auto", store=False,
            reasoning_effort="low", parallel_tool_calls=True, user="u1",
            extra_body={"chat_template_kwargs": {"enable_thinking": False},
                        "some_future_option": {"x": 1}})
        assert out.choices[0].message.content
    log = server.log()
    for name in ("metadata", "service_tier", "reasoning_effort", "some_future_option",
                 "messages.cache_hint"):
        assert log.count(f"ignoring the request field '{name}'") == 1, name


@pytest.mark.parametrize("route, body, param", [
    ("completions", {"prompt": "x", "suffix": "y"}, "suffix"),
    ("completions", {"prompt": "x", "best_of": 3}, "best_of"),
    ("chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]},
     "messages[0].content[0].type"),
    ("chat/completions", {"messages": ASK, "functions": [{"name": "f"}]}, "functions"),
    ("chat/completions", {"messages": ASK, "stream_options": {"include_usage": True}},
     "stream_options"),
    ("responses", {"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
    ("responses", {"input": "x", "tools": [{"type": "web_search"}]}, "tools[0]"),
])
def test_options_that_would_change_the_result_are_still_refused(client, route, body, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.post(f"/{route}", body={"model": MODEL, **body}, cast_to=object)
    assert e.value.body["param"] == param
