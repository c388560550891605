"""Tool-call parsers on model outputs: what a client gets streamed equals what it gets whole,
malformed output stays text, and forced (grammar-shaped) outputs read back exactly."""

from __future__ import annotations

import json

import pytest

from asyncengine.text.tool_parsers import (
    TOOL_PARSERS,
    HermesToolParser,
    Llama3JsonToolParser,
    NamedFunctionParser,
    ParsedDelta,
    RequiredCallsParser,
    ToolParser,
    get_tool_parser,
)


def streamed(parser: ToolParser, pieces: list[str]) -> ParsedDelta:
    """Everything a stream sends, merged per call (as OpenAI clients merge deltas)."""
    out = ParsedDelta()
    for piece in pieces:
        out.extend(parser.feed(piece))
    out.extend(parser.finish())
    return out


def chunks(text: str, size: int) -> list[str]:
    return [text[i:i + size] for i in range(0, len(text), size)]


QWEN = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par\\"is", '
        '"days": [1, {"unit": "}"}]}}\n</tool_call>\n<tool_call>\n{"arguments": {"tz": "CET"}, '
        '"name": "get_time"}\n</tool_call>')
LLAMA = ('{"name": "get_weather", "parameters": {"city": "Rome"}}; '
         '{"name": "get_time", "parameters": "{\\"tz\\": \\"UTC\\"}"}')


@pytest.mark.parametrize("size", [1, 3, 7, 1000])
def test_hermes_calls_streamed_in_any_pieces_equal_the_whole_parse(size):
    whole = HermesToolParser().parse(QWEN)
    assert whole.content == "Let me check.\n"
    assert [(c.name, json.loads(c.arguments)) for c in whole.calls] == [
        ("get_weather", {"city": 'Par"is', "days": [1, {"unit": "}"}]}),
        ("get_time", {"tz": "CET"})]
    out = streamed(HermesToolParser(), chunks(QWEN, size))
    assert out.content == whole.content
    assert [(c.index, c.name, c.arguments) for c in out.calls] == [
        (i, c.name, c.arguments) for i, c in enumerate(whole.calls)]


def test_hermes_names_a_call_before_its_arguments_end():
    parser = HermesToolParser()
    first = parser.feed('<tool_call>\n{"name": "get_weather", "arguments": {"ci')
    assert first.content == ""
    assert [(c.index, c.name) for c in first.calls] == [(0, "get_weather")]
    assert first.calls[0].arguments == '{"ci'
    rest = parser.feed('ty": "Oslo"}}\n</tool_call>')
    assert rest.calls[0].name is None and rest.calls[0].arguments == 'ty": "Oslo"}'


def test_hermes_holds_back_a_partial_tag_and_keeps_plain_text():
    parser = HermesToolParser()
    assert parser.feed("The answer <tool").content == "The answer "
    assert parser.feed(" is no tag").content == "<tool is no tag"
    assert not parser.made_calls
    assert HermesToolParser().parse("Just text.").content == "Just text."


@pytest.mark.parametrize("text", [
    'Hi <tool_call>\n{"name": "f", "arguments": {"a": ',  # cut off inside a call
    '<tool_call>\n{"name": "f" "arguments": {}}\n</tool_call>',  # broken JSON
    '<tool_call>\n{"arguments": {}}\n</tool_call>',  # no name
])
def test_malformed_calls_are_returned_as_text(text):
    out = HermesToolParser().parse(text)
    assert out.calls == [] and out.content == text


@pytest.mark.parametrize("size", [1, 5, 1000])
def test_llama3_json_calls(size):
    whole = Llama3JsonToolParser().parse(LLAMA)
    assert whole.content is None
    assert [(c.name, json.loads(c.arguments)) for c in whole.calls] == [
        ("get_weather", {"city": "Rome"}), ("get_time", {"tz": "UTC"})]
    out = streamed(Llama3JsonToolParser(), chunks(LLAMA, size))
    assert [(c.name, c.arguments) for c in out.calls] == [
        (c.name, c.arguments) for c in whole.calls]
    tagged = Llama3JsonToolParser().parse('<|python_tag|>{"name": "f", "parameters": {}}')
    assert [(c.name, c.arguments) for c in tagged.calls] == [("f", "{}")]


def test_llama3_json_plain_text_is_content():
    out = streamed(Llama3JsonToolParser(), chunks("  The weather is fine {really}.", 4))
    assert out.content == "  The weather is fine {really}." and out.calls == []


def test_forced_outputs():
    required = '[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "f", ' \
               '"arguments": {}}]'
    whole = RequiredCallsParser().parse(required)
    assert [(c.name, c.arguments) for c in whole.calls] == [
        ("get_weather", '{"city": "Paris"}'), ("f", "{}")]
    out = streamed(RequiredCallsParser(), chunks(required, 2))
    assert [(c.name, c.arguments) for c in out.calls] == [
        (c.name, c.arguments) for c in whole.calls]
    assert RequiredCallsParser().parse('[{"name": "f", "argu').calls == []  # cut short
    named = streamed(NamedFunctionParser("get_time"), ['{"tz"', ': "UTC"}'])
    assert [(c.index, c.name, c.arguments) for c in named.calls] == [
        (0, "get_time", '{"tz": "UTC"}')]


def test_registry_names_vllms_parsers():
    assert {"hermes", "llama3_json"} <= set(TOOL_PARSERS)
    assert get_tool_parser("hermes") is HermesToolParser
    with pytest.raises(ValueError, match="--tool-call-parser"):
        get_tool_parser("nope")
