"""Request bodies of the OpenAI-compatible API, as msgspec Structs.

Every Struct forbids unknown fields: a parameter the server does not implement is a 400 that
names it, never silently ignored. Optional fields default to ``None`` (a client may send
``null`` for any of them); the defaults OpenAI and vLLM document are applied when the request
is turned into ``SamplingParams`` (``asyncengine.entrypoints.http.params``).
"""

from __future__ import annotations

from typing import Any, Literal

from msgspec import Struct, field


class Body(Struct, forbid_unknown_fields=True, kw_only=True):
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


class CompletionRequest(GenerationBody, kw_only=True):
    """POST /v1/completions. ``prompt``: a string, a list of strings, a list of token ids or a
    list of token-id lists (one engine request per prompt)."""

    prompt: str | list[str | int | list[int]]
    echo: bool | None = None
    logprobs: int | None = None


# -- chat --------------------------------------------------------------------------------------
class TextPart(Body, kw_only=True, tag="text", tag_field="type"):
    text: str


Role = Literal["system", "developer", "user", "assistant", "tool"]


class ChatMessage(Body, kw_only=True):
    role: Role
    content: str | list[TextPart] | None = None
    name: str | None = None


class ChatCompletionRequest(GenerationBody, kw_only=True):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    add_generation_prompt: bool | None = None


# -- tokenizer routes --------------------------------------------------------------------------
class TokenizeRequest(Body, kw_only=True):
    """POST /tokenize: either ``prompt`` or ``messages`` (rendered with the chat template)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = None
    return_token_strs: bool | None = None


class DetokenizeRequest(Body, kw_only=True):
    model: str | None = None
    tokens: list[int]


def message_dicts(messages: list[ChatMessage]) -> list[dict[str, str]]:
    """Messages as the chat template expects them (text parts joined by newlines)."""
    out = []
    for m in messages:
        content = m.content
        if isinstance(content, list):
            content = "\n".join(p.text for p in content)
        d = {"role": "system" if m.role == "developer" else m.role, "content": content or ""}
        if m.name is not None:
            d["name"] = m.name
        out.append(d)
    return out

