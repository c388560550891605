"""Request bodies of the OpenAI-compatible API, as msgspec Structs.

Unknown fields are accepted and ignored, as OpenAI's and vLLM's servers do (clients send
``metadata``, ``service_tier``, ``parallel_tool_calls``...); the server logs each ignored
field name once (``tolerant.py``). Known options the server cannot honour and that would
change the result (``suffix``, ``best_of`` > 1, image parts...) are still a 400 naming them
(``unsupported``). Optional fields default to ``None`` (a client may send ``null`` for any of
them); the defaults OpenAI and vLLM document are applied when the request is turned into
``SamplingParams`` (``asyncengine.entrypoints.http.params``).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from msgspec import Struct, field


class Body(Struct, kw_only=True):
    """Base of every request body."""


class StreamOptions(Body, kw_only=True):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None


# -- structured outputs ------------------------------------------------------------------------
class JsonSchemaSpec(Body, kw_only=True):
    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = field(default=None, name="schema")
    strict: bool | None = None


class ResponseFormatText(Body, kw_only=True, tag="text", tag_field="type"):
    pass


class ResponseFormatJsonObject(Body, kw_only=True, tag="json_object", tag_field="type"):
    pass


class ResponseFormatJsonSchema(Body, kw_only=True, tag="json_schema", tag_field="type"):
    json_schema: JsonSchemaSpec


ResponseFormat = ResponseFormatText | ResponseFormatJsonObject | ResponseFormatJsonSchema


class StructuredOutputs(Body, kw_only=True):
    """vLLM's ``structured_outputs``: exactly one of the fields."""

    json: dict[str, Any] | str | None = None
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


# -- the sampling parameters both endpoints share ---------------------------------------------
class GenerationBody(Body, kw_only=True):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    response_format: ResponseFormat | None = None
    # vLLM's extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    priority: int | None = None
    structured_outputs: StructuredOutputs | None = None
    # vLLM's older names for structured outputs (mapped onto ``structured_outputs``)
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # Known, would change the result, not implemented: a 400 when set (see ``unsupported``).
    best_of: int | None = None
    use_beam_search: bool | None = None
    prompt_logprobs: int | None = None


class CompletionRequest(GenerationBody, kw_only=True):
    """POST /v1/completions. ``prompt``: a string, a list of strings, a list of token ids or a
    list of token-id lists (one engine request per prompt)."""

    prompt: str | list[str | int | list[int]]
    echo: bool | None = None
    logprobs: int | None = None
    suffix: str | None = None


# -- chat --------------------------------------------------------------------------------------
class TextPart(Body, kw_only=True, tag="text", tag_field="type"):
    text: str


Role = Literal["system", "developer", "user", "assistant", "tool"]


class FunctionCall(Body, kw_only=True):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCall(Body, kw_only=True):
    """A call the assistant made, in the conversation history."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(Body, kw_only=True):
    role: Role
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant messages
    tool_call_id: str | None = None  # tool messages


class FunctionDefinition(Body, kw_only=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(Body, kw_only=True):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class FunctionName(Body, kw_only=True):
    name: str


class NamedToolChoice(Body, kw_only=True):
    type: Literal["function"] = "function"
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ChatCompletionRequest(GenerationBody, kw_only=True):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatTool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # Reasoning models (--reasoning-parser): end the reasoning after this many tokens.
    thinking_token_budget: int | None = None
    include_reasoning: bool | None = None  # false: the reasoning is split off and dropped
    # Known, not implemented (a 400 when set).
    functions: list[Any] | None = None
    function_call: Any | None = None
    audio: Any | None = None
    modalities: list[str] | None = None
    echo: bool | None = None
    web_search_options: Any | None = None


# -- tokenizer routes --------------------------------------------------------------------------
class TokenizeRequest(Body, kw_only=True):
    """POST /tokenize: either ``prompt`` or ``messages`` (rendered with the chat template,
    with ``tools`` when given)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[ChatTool] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = None
    return_token_strs: bool | None = None


class DetokenizeRequest(Body, kw_only=True):
    model: str | None = None
    tokens: list[int]


#: Set, these change the result and the server cannot honour them: (field, test, why).
_UNSUPPORTED: tuple[tuple[str, Any, str], ...] = (
    ("suffix", bool, "insertion (suffix) is not supported"),
    ("best_of", lambda v: v != 1, "best_of > 1 is not supported (use n)"),
    ("use_beam_search", bool, "beam search is not supported"),
    ("prompt_logprobs", lambda v: True, "prompt_logprobs is not supported (completions: use "
                                        "echo with logprobs)"),
    ("functions", lambda v: True, "the deprecated functions parameter is not supported: use "
                                  "tools"),
    ("function_call", lambda v: True, "the deprecated function_call parameter is not "
                                      "supported: use tool_choice"),
    ("audio", lambda v: True, "audio output is not supported"),
    ("modalities", lambda v: any(m != "text" for m in v), "only the text modality is "
                                                          "supported"),
    ("echo", bool, "echo is not supported for chat"),
    ("web_search_options", lambda v: True, "web search is not supported"),
)


def unsupported(body: Body) -> tuple[str, str] | None:
    """``(param, message)`` for the first option set that the server cannot honour."""
    chat = isinstance(body, ChatCompletionRequest)
    for name, test, why in _UNSUPPORTED:
        if name == "echo" and not chat:  # completions' echo is implemented
            continue
        value = getattr(body, name, None)
        if value is not None and test(value):
            return name, f"Unsupported parameter: '{name}': {why}."
    return None


def message_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as chat templates expect them: text parts joined by newlines; tool calls
    with their arguments as objects (transformers' templates ``tojson`` them)."""
    out = []
    for m in messages:
        content = m.content
        if isinstance(content, list):
            content = "\n".join(p.text for p in content)
        d: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role,
                             "content": content or ""}
        if m.name is not None:
            d["name"] = m.name
        if m.tool_calls:
            calls = []
            for c in m.tool_calls:
                args: Any = c.function.arguments
                if isinstance(args, str):
                    try:
                        args = json.loads(args)
                    except ValueError:
                        pass  # left as the model wrote it
                calls.append({"id": c.id, "type": "function",
                              "function": {"name": c.function.name, "arguments": args}})
            d["tool_calls"] = calls
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        out.append(d)
    return out
