"""Reasoning models end to end, with the official openai client: the tiny random llama served
through a DeepSeek-R1-style template (the prompt opens ``<think>``) with
``--reasoning-parser deepseek_r1``. Its free output is reasoning; ``thinking_token_budget``
ends it by forcing ``</think>``, and a structured output (or a forced tool call) then shapes
only the answer: so the model's output is known to hold a reasoning span, an end tag and an
answer without any of it being faked. The template's thinking switch (DeepSeek-V3.1's
``thinking``) is on from ``--default-chat-template-kwargs``, and off from a request's
``chat_template_kwargs``."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request

import openai
import pytest

from tests.robust_utils import assert_idle_and_free
from tests.server_utils import KEY, TEMPLATES, ServerProcess, shared_server

ASK = [{"role": "user", "content": "Paris or Rome?"}]
CITIES = ["Paris", "Rome"]
BUDGET = 6
WEATHER = {"type": "object", "properties": {"city": {"enum": CITIES}}, "required": ["city"],
           "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]


def r1_server(tiny_llama: str) -> ServerProcess:
    """Shared with test_messages_api.py."""
    return shared_server(tiny_llama, "--chat-template", str(TEMPLATES / "deepseek_r1.jinja"),
                         "--reasoning-parser", "deepseek_r1", "--enable-auto-tool-choice",
                         "--default-chat-template-kwargs", '{"thinking": true}',
                         "--tool-call-parser", "hermes", "--num-gpu-blocks-override", "256",
                         api_key=KEY)


@pytest.fixture(scope="module")
def server(tiny_llama) -> ServerProcess:
    return r1_server(tiny_llama)


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url("/v1"), api_key=KEY, max_retries=0, timeout=60)


def reasoning_of(obj) -> str | None:
    """``reasoning``, checked equal to ``reasoning_content`` (both are sent)."""
    extra = obj.model_extra or {}
    assert extra.get("reasoning") == extra.get("reasoning_content")
    return extra.get("reasoning")


def budgeted(**extra) -> dict:
    return dict(model=None, messages=ASK, max_tokens=40, temperature=0,
                extra_body={"thinking_token_budget": BUDGET,
                            "structured_outputs": {"choice": CITIES}, **extra})


def test_reasoning_and_content_apart(client, server):
    kwargs = budgeted()
    kwargs.pop("model")
    out = client.chat.completions.create(model=server_model(client), **kwargs)
    msg = out.choices[0].message
    assert msg.content in CITIES  # the structured output shaped the answer only
    thought = reasoning_of(msg)
    assert thought and "</think>" not in thought and "<think>" not in thought
    assert out.usage.completion_tokens_details.reasoning_tokens == BUDGET
    assert out.choices[0].finish_reason == "stop"
    # Streamed: the same split, delta by delta.
    stream = client.chat.completions.create(model=server_model(client), stream=True,
                                            stream_options={"include_usage": True}, **kwargs)
    reasoning, content, usage = "", "", None
    for chunk in stream:
        for choice in chunk.choices:
            reasoning += reasoning_of(choice.delta) or ""
            content += choice.delta.content or ""
        usage = chunk.usage or usage
    assert (reasoning, content) == (thought, msg.content)
    assert usage.completion_tokens_details.reasoning_tokens == BUDGET


def server_model(client) -> str:
    return client.models.list().data[0].id


def test_include_reasoning_false_drops_it(client):
    kwargs = budgeted(include_reasoning=False)
    kwargs.pop("model")
    out = client.chat.completions.create(model=server_model(client), **kwargs)
    msg = out.choices[0].message
    assert msg.content in CITIES and reasoning_of(msg) is None
    assert out.usage.completion_tokens_details.reasoning_tokens == BUDGET


def test_unclosed_reasoning_at_max_tokens_is_all_reasoning(client):
    out = client.chat.completions.create(model=server_model(client), messages=ASK,
                                         max_tokens=8, temperature=0)
    msg = out.choices[0].message
    assert out.choices[0].finish_reason == "length"
    assert msg.content is None and reasoning_of(msg)
    assert out.usage.completion_tokens_details.reasoning_tokens == 8


def test_forced_tool_call_follows_the_reasoning(client):
    out = client.chat.completions.create(
        model=server_model(client), messages=ASK, tools=TOOLS, tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=60, temperature=0, extra_body={"thinking_token_budget": BUDGET})
    msg = out.choices[0].message
    assert reasoning_of(msg)
    [call] = msg.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments)["city"] in CITIES
    assert out.choices[0].finish_reason == "tool_calls"


def test_auto_tool_call_parsed_from_the_answer_only(client):
    """The answer is shaped (by a regex, after the reasoning) into a Hermes tool call that
    --tool-call-parser hermes reads; the reasoning before it is not parsed for calls."""
    call = (r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)"\}\}'
            r'\n</tool_call>')
    kwargs = dict(model=server_model(client), messages=ASK, tools=TOOLS, max_tokens=60,
                  temperature=0, extra_body={"thinking_token_budget": BUDGET,
                                             "structured_outputs": {"regex": call}})
    out = client.chat.completions.create(**kwargs)
    msg = out.choices[0].message
    assert reasoning_of(msg) and not msg.content
    [tc] = msg.tool_calls
    assert tc.function.name == "get_weather" and out.choices[0].finish_reason == "tool_calls"
    reasoning, args, finish = "", "", None
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            reasoning += reasoning_of(choice.delta) or ""
            assert not choice.delta.content
            for piece in choice.delta.tool_calls or []:
                args += piece.function.arguments or ""
            finish = choice.finish_reason or finish
    assert reasoning == reasoning_of(msg) and finish == "tool_calls"
    assert json.loads(args) == json.loads(tc.function.arguments)


def test_parsers_among_plain_streams_give_what_they_give_alone(client):
    """A reasoning request and a tool call (each parsed from the text the model streams) run
    among 20 plain streams, a batch past the step path's few-row limit (its rows gathered as
    arrays, ``executor/step/step_rows.py``): each answer equals its run alone."""
    from concurrent.futures import ThreadPoolExecutor
    from threading import Barrier

    model = server_model(client)
    call = (r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)"\}\}'
            r'\n</tool_call>')
    tool = dict(model=model, messages=ASK, tools=TOOLS, max_tokens=60, temperature=0,
                extra_body={"thinking_token_budget": BUDGET, "structured_outputs": {"regex": call}})
    reason = budgeted(model=model)
    plain = dict(model=model, prompt="Once upon a time", max_tokens=120, temperature=0,
                 extra_body={"ignore_eos": True})

    def summary(out) -> tuple:
        msg = out.choices[0].message
        calls = [(c.function.name, json.loads(c.function.arguments))
                 for c in msg.tool_calls or []]
        return reasoning_of(msg), msg.content, calls, out.choices[0].finish_reason

    alone = [summary(client.chat.completions.create(**tool)),
             summary(client.chat.completions.create(**reason))]
    alone_plain = client.completions.create(**plain).choices[0].text
    started = Barrier(21)  # the plain streams and this thread

    def stream_plain() -> str:
        text = ""
        for i, chunk in enumerate(client.completions.create(**plain, stream=True)):
            if i == 0:
                started.wait(timeout=60)
            text += "".join(c.text for c in chunk.choices)
        return text

    with ThreadPoolExecutor(24) as pool:
        plains = [pool.submit(stream_plain) for _ in range(20)]
        started.wait(timeout=60)  # every plain stream decodes: the parsers' requests join them
        mixed = [pool.submit(client.chat.completions.create, **kw) for kw in (tool, reason)]
        got = [summary(f.result()) for f in mixed]
        texts = [f.result() for f in plains]
    assert got == alone
    assert alone[0][2] and alone[1][0]  # a parsed tool call; a reasoning span
    assert texts == [alone_plain] * 20


def test_min_tokens_holds_with_a_budget_alone(client, tiny_llama):
    """The budget's gate does not end the output, so min_tokens still holds EOS back: with
    EOS pushed to the top, the output is exactly min_tokens tokens (the reasoning cut at the
    budget by the forced tag inside it), then EOS (counted in completion_tokens)."""
    import transformers

    eos = transformers.AutoTokenizer.from_pretrained(tiny_llama).eos_token_id
    out = client.chat.completions.create(
        model=server_model(client), messages=ASK, max_tokens=30, temperature=0,
        logit_bias={str(eos): 100},
        extra_body={"thinking_token_budget": 3, "min_tokens": 12})
    assert out.usage.completion_tokens == 12 + 1 and out.choices[0].finish_reason == "stop"
    assert out.usage.completion_tokens_details.reasoning_tokens == 3
    assert reasoning_of(out.choices[0].message)


def test_budget_needs_a_non_negative_integer(client):
    with pytest.raises(openai.BadRequestError, match="thinking_token_budget"):
        client.chat.completions.create(model=server_model(client), messages=ASK, max_tokens=4,
                                       extra_body={"thinking_token_budget": -1})


def test_thinking_off_from_the_request_over_the_server_default(client, server):
    model = server_model(client)
    off = client.chat.completions.create(model=model, messages=ASK, max_tokens=6, temperature=0,
                                         extra_body={"chat_template_kwargs": {"thinking": False}})
    on = client.chat.completions.create(model=model, messages=ASK, max_tokens=6, temperature=0)
    # The server's default (thinking on) opened <think> in the prompt; the request closed it.
    assert on.choices[0].message.content is None and reasoning_of(on.choices[0].message)
    msg = off.choices[0].message
    assert msg.content and reasoning_of(msg) is None  # all of it is the answer
    assert off.usage.completion_tokens_details.reasoning_tokens == 0
    # /tokenize renders the same prompts: the server default, then the request's override.
    for kwargs, usage in (({}, on.usage), ({"chat_template_kwargs": {"thinking": False}},
                                          off.usage)):
        req = urllib.request.Request(
            server.url("/tokenize"), data=json.dumps({"messages": ASK, **kwargs}).encode(),
            headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as r:
            assert json.loads(r.read())["count"] == usage.prompt_tokens


@pytest.mark.parametrize("flags,named", [
    (["--reasoning-parser", "nope"], "--reasoning-parser"),
    (["--default-chat-template-kwargs", "[1]"], "--default-chat-template-kwargs"),
])
def test_bad_flags_exit_2_naming_the_flag(tiny_llama, flags, named):
    r = subprocess.run([sys.executable, "-m", "asyncengine", "serve", tiny_llama, *flags],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and named in r.stderr


def test_responses_api_reasoning_item_before_the_message(client):
    model = server_model(client)
    kwargs = dict(model=model, input="Paris or Rome?", max_output_tokens=40, temperature=0,
                  text={"format": {"type": "json_schema", "name": "city", "schema": WEATHER}},
                  extra_body={"thinking_token_budget": BUDGET})
    out = client.responses.create(**kwargs)
    assert [item.type for item in out.output] == ["reasoning", "message"]
    reasoning, message = out.output
    assert reasoning.content[0].type == "reasoning_text" and reasoning.content[0].text
    assert json.loads(message.content[0].text)["city"] in CITIES
    assert out.usage.output_tokens_details.reasoning_tokens == BUDGET
    with client.responses.stream(**kwargs) as stream:
        deltas = [e.delta for e in stream if e.type == "response.reasoning_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == reasoning.content[0].text
    assert [i.type for i in final.output] == ["reasoning", "message"]
    assert final.output[0].content[0].text == reasoning.content[0].text
    assert final.output[1].content[0].text == message.content[0].text


def test_every_block_free_after_the_reasoning_requests(server):
    assert_idle_and_free(server)
