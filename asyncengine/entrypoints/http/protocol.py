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
from typing import Annotated, Any, Literal

from msgspec import Meta, Struct, field

from asyncengine.core.limits import INT64_MAX, INT64_MIN

# Integer fields carry their ranges in their types: msgspec refuses a value outside them while
# decoding (a 400 naming the field) and writes them into /openapi.json, so the two cannot
# drift. Bounds that depend on the served model or the server's flags (the vocabulary,
# --max-n, --max-logprobs, the context length) are checked with the sampling parameters and
# published by ``openapi_ranges.py``.
Int64 = Annotated[int, Meta(ge=INT64_MIN, le=INT64_MAX)]
Count = Annotated[int, Meta(ge=0, le=INT64_MAX)]
PositiveCount = Annotated[int, Meta(ge=1, le=INT64_MAX)]
TokenId = Annotated[int, Meta(ge=0, le=INT64_MAX)]  # and below the vocabulary size
#: A token count that may be 0 (a thinking budget, Anthropic's max_tokens).
TokenCount = Annotated[int, Meta(ge=0, le=INT64_MAX)]
NonEmptyStr = Annotated[str, Meta(min_length=1)]
#: A completions prompt (an embeddings input): a string, a list of strings, a list of token
#: ids or a list of token-id lists, none of them empty (and the lists not mixed: checked by
#: ``completion_prompts``, published by ``openapi_ranges.prompt_schema``).
Prompt = NonEmptyStr | Annotated[list[NonEmptyStr | TokenId | Annotated[
    list[TokenId], Meta(min_length=1)]], Meta(min_length=1)]


class Body(Struct, kw_only=True):
    """Base of every request body."""


class StreamOptions(Body, kw_only=True):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None


# -- structured outputs ------------------------------------------------------------------------
class JsonSchemaSpec(Body, kw_only=True):
    name: str
    description: str | None = None
    schema_: dict[str, Any] = field(name="schema")  # required: what constrains the output
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
    choice: Annotated[list[str], Meta(min_length=1)] | None = None
    grammar: str | None = None


# -- the sampling parameters both endpoints share ---------------------------------------------
class GenerationBody(Body, kw_only=True):
    model: str | None = None
    max_tokens: PositiveCount | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: PositiveCount | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: Int64 | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    response_format: ResponseFormat | None = None
    # vLLM's extensions
    top_k: Annotated[int, Meta(ge=-1)] | None = None  # past the vocabulary: all tokens
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: Count | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[TokenId] | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    priority: Int64 | None = None
    structured_outputs: StructuredOutputs | None = None
    # vLLM's older names for structured outputs (mapped onto ``structured_outputs``)
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: Annotated[list[str], Meta(min_length=1)] | None = None
    guided_grammar: str | None = None
    # Known, would change the result, not implemented: a 400 when set (see ``unsupported``).
    best_of: PositiveCount | None = None
    use_beam_search: bool | None = None
    prompt_logprobs: Count | None = None


class CompletionRequest(GenerationBody, kw_only=True):
    """POST /v1/completions. ``prompt``: a string, a list of strings, a list of token ids or a
    list of token-id lists (one engine request per prompt)."""

    prompt: Prompt
    echo: bool | None = None
    logprobs: Count | None = None
    suffix: str | None = None


# -- chat --------------------------------------------------------------------------------------
class TextPart(Body, kw_only=True, tag="text", tag_field="type"):
    text: str


class ImageURL(Body, kw_only=True):
    url: NonEmptyStr  # data:, http(s): or file: (``entrypoints/http/media.py``)
    detail: str | None = None


class ImageURLPart(Body, kw_only=True, tag="image_url", tag_field="type"):
    image_url: ImageURL | NonEmptyStr

    @property
    def url(self) -> str:
        return self.image_url if isinstance(self.image_url, str) else self.image_url.url


#: A part of a message's content: text, or an image (vision-language models).
ContentPart = TextPart | ImageURLPart


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
    content: str | list[ContentPart] | None = None
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

    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    max_completion_tokens: PositiveCount | None = None
    logprobs: bool | None = None
    top_logprobs: Count | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # The image processor's options (vLLM's): over --mm-processor-kwargs, key by key.
    mm_processor_kwargs: dict[str, Any] | None = None
    tools: Annotated[list[ChatTool], Meta(min_length=1)] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # Reasoning models (--reasoning-parser): end the reasoning after this many tokens.
    thinking_token_budget: TokenCount | None = None
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
    """POST /tokenize: one of ``prompt``, ``messages`` (rendered with the chat template,
    with ``tools`` and ``chat_template_kwargs`` when given) and ``content`` (llama-server's
    name for ``prompt``, with its ``add_special``)."""

    model: str | None = None
    prompt: str | None = None
    content: str | None = None
    add_special: bool | None = None
    messages: Annotated[list[ChatMessage], Meta(min_length=1)] | None = None
    tools: list[ChatTool] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool | None = None


class DetokenizeRequest(Body, kw_only=True):
    model: str | None = None
    tokens: list[TokenId]


#: Set, these change the result and the server cannot honour them: (field, test, why, the
#: JSON Schema of the values it does accept, which /openapi.json publishes).
_NULL: dict[str, Any] = {"type": "null"}
_UNSUPPORTED: tuple[tuple[str, Any, str, dict[str, Any]], ...] = (
    ("suffix", bool, "insertion (suffix) needs a model with fill-in-the-middle tokens",
     {"anyOf": [{"const": ""}, _NULL]}),
    ("best_of", lambda v: v != 1, "best_of > 1 is not supported (use n)",
     {"anyOf": [{"const": 1}, _NULL]}),
    ("use_beam_search", bool, "beam search is not supported",
     {"anyOf": [{"const": False}, _NULL]}),
    ("prompt_logprobs", lambda v: True, "prompt_logprobs is not supported (completions: use "
                                        "echo with logprobs)", _NULL),
    ("functions", lambda v: True, "the deprecated functions parameter is not supported: use "
                                  "tools", _NULL),
    ("function_call", lambda v: True, "the deprecated function_call parameter is not "
                                      "supported: use tool_choice", _NULL),
    ("audio", lambda v: True, "audio output is not supported", _NULL),
    ("modalities", lambda v: any(m != "text" for m in v), "only the text modality is "
                                                          "supported",
     {"anyOf": [{"type": "array", "items": {"const": "text"}}, _NULL]}),
    ("echo", bool, "echo is not supported for chat", {"anyOf": [{"const": False}, _NULL]}),
    ("web_search_options", lambda v: True, "web search is not supported", _NULL),
)


def accepted_values(body: type[Body]) -> dict[str, dict[str, Any]]:
    """The JSON Schema of the values ``unsupported`` lets through, per field of ``body``."""
    chat = issubclass(body, ChatCompletionRequest)
    names = set(body.__struct_fields__)
    return {name: schema for name, _, _, schema in _UNSUPPORTED
            if name in names and (chat or name != "echo")}


def unsupported(body: Body, allow: frozenset[str] = frozenset()) -> tuple[str, str] | None:
    """``(param, message)`` for the first option set that the server cannot honour
    (``allow``: those this server honours after all, such as a code model's ``suffix``)."""
    chat = isinstance(body, ChatCompletionRequest)
    for name, test, why, _ in _UNSUPPORTED:
        if (name == "echo" and not chat) or name in allow:  # completions' echo is implemented
            continue
        value = getattr(body, name, None)
        if value is not None and test(value):
            return name, f"Unsupported parameter: '{name}': {why}."
    return None


def image_urls(messages: list[ChatMessage]) -> list[str]:
    """The URLs of the messages' image parts, in order."""
    return [p.url for m in messages if isinstance(m.content, list)
            for p in m.content if isinstance(p, ImageURLPart)]


def message_dicts(messages: list[ChatMessage],
                  image_placeholder: str = "") -> list[dict[str, Any]]:
    """Messages as chat templates expect them: parts joined by newlines, each image part as
    the model's ``image_placeholder`` (in place: text and images interleave as sent); tool
    calls with their arguments as objects (transformers' templates ``tojson`` them)."""
    out = []
    for m in messages:
        content = m.content
        if isinstance(content, list):
            content = "\n".join(p.text if isinstance(p, TextPart) else image_placeholder
                                for p in content)
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
