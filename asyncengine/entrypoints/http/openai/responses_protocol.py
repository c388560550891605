"""OpenAI's Responses API (``POST /v1/responses``), stateless: the request and response
bodies, and the conversion of its input items to chat messages.

Input items are read by their ``type`` (a message may leave it out): messages (text parts
``input_text`` / ``output_text``), ``function_call`` (a call the model made earlier) and
``function_call_output`` (its result). Anything that needs stored state
(``previous_response_id``, ``conversation``, ``background``) or a tool other than a
function is a 400 naming it.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct, field

from asyncengine.entrypoints.http.errors import bad_request, from_decode_error
from asyncengine.entrypoints.http.protocol import (
    Body,
    ChatMessage,
    ChatTool,
    FunctionCall,
    FunctionDefinition,
    FunctionName,
    ImageURLPart,
    NamedToolChoice,
    NonEmptyStr,
    PositiveCount,
    TextPart,
    TokenCount,
    ToolCall,
    ToolChoice,
)


class TextFormat(Body, kw_only=True):
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    schema_: dict[str, Any] | None = field(default=None, name="schema")
    strict: bool | None = None
    description: str | None = None


class TextConfig(Body, kw_only=True):
    format: TextFormat | None = None


class ResponsesRequest(Body, kw_only=True):
    # Not empty, as every generation route's input (published with each item's schema by
    # ``openapi_ranges``; the items are checked one by one in ``chat_messages``).
    input: NonEmptyStr | Annotated[list[dict[str, Any]], Meta(min_length=1)]
    model: str | None = None
    instructions: str | None = None
    max_output_tokens: PositiveCount | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: dict[str, Any] | None = None  # OpenAI's effort/summary: accepted, not used
    # vLLM's extension (--reasoning-parser): end the reasoning after this many tokens.
    thinking_token_budget: TokenCount | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    # Known, need server-side state: a 400 when set.
    previous_response_id: str | None = None
    conversation: Any | None = None
    background: bool | None = None


# -- input items ----------------------------------------------------------------------------
class _Text(Body, kw_only=True):
    text: str


class InputText(_Text, kw_only=True, tag="input_text", tag_field="type"):
    pass


class OutputTextIn(_Text, kw_only=True, tag="output_text", tag_field="type"):
    pass


class PlainText(_Text, kw_only=True, tag="text", tag_field="type"):
    pass


TextParts = InputText | OutputTextIn | PlainText


class InputImage(Body, kw_only=True, tag="input_image", tag_field="type"):
    """An image part: ``image_url`` a data:, http(s): or file: URL, or ``file_id`` a file
    uploaded with purpose ``vision`` or ``user_data`` (read by ``file_images.py``)."""

    image_url: Annotated[str, Meta(min_length=1)] | None = None
    file_id: Annotated[str, Meta(min_length=1)] | None = None
    detail: str | None = None


class InputMessage(Body, kw_only=True):
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[TextParts | InputImage]
    type: Literal["message"] = "message"


class InputFunctionCall(Body, kw_only=True):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class InputFunctionCallOutput(Body, kw_only=True):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[TextParts]


_ITEMS = {"message": InputMessage, "function_call": InputFunctionCall,
          "function_call_output": InputFunctionCallOutput}
#: The input item types, for /openapi.json.
INPUT_ITEMS = tuple(_ITEMS.values())


#: Options that need server-side state: (field, why, the JSON Schema of the values accepted).
_REFUSED: tuple[tuple[str, str, dict[str, Any]], ...] = (
    ("previous_response_id", "this server keeps no responses (stateless): send the whole "
                             "conversation as input", {"type": "null"}),
    ("conversation", "this server keeps no conversations (stateless)", {"type": "null"}),
    ("background", "background responses are not supported",
     {"anyOf": [{"const": False}, {"type": "null"}]}),
)
#: For /openapi.json: what each refused option accepts.
REFUSED_ACCEPTS = {name: schema for name, _, schema in _REFUSED}


def refused(body: ResponsesRequest) -> None:
    for name, why, _ in _REFUSED:
        value = getattr(body, name)
        if value is not None and not (name == "background" and value is False):
            raise bad_request(f"Unsupported parameter: '{name}': {why}.", name)


def chat_messages(body: ResponsesRequest) -> list[ChatMessage]:
    """The conversation the chat template renders: instructions, then the input items."""
    messages: list[ChatMessage] = []
    if body.instructions:
        messages.append(ChatMessage(role="system", content=body.instructions))
    if isinstance(body.input, str):
        messages.append(ChatMessage(role="user", content=body.input))
        return messages
    for i, raw in enumerate(body.input):
        kind = raw.get("type", "message") if isinstance(raw, dict) else None
        if kind == "reasoning":  # an earlier turn's thinking: templates drop it anyway
            continue
        cls = _ITEMS.get(kind) if isinstance(kind, str) else None
        if cls is None:
            raise bad_request(f"input item type {kind!r} is not supported (message, "
                              "function_call, function_call_output)", f"input[{i}].type")
        try:
            item = msgspec.convert(raw, cls)
        except msgspec.ValidationError as e:
            err = from_decode_error(e)
            raise bad_request(err.message, f"input[{i}]" + (f".{err.param}" if err.param
                                                             else "")) from None
        if isinstance(item, InputMessage):
            if not isinstance(item.content, str):
                for j, p in enumerate(item.content):
                    if isinstance(p, InputImage) and p.image_url is None:
                        raise bad_request("an input_image needs image_url or file_id",
                                          f"input[{i}].content[{j}]")
            content = item.content if isinstance(item.content, str) else [
                ImageURLPart(image_url=p.image_url) if isinstance(p, InputImage)
                else TextPart(text=p.text) for p in item.content]
            messages.append(ChatMessage(role=item.role, content=content))
        elif isinstance(item, InputFunctionCall):
            call = ToolCall(id=item.call_id, function=FunctionCall(name=item.name,
                                                                   arguments=item.arguments))
            last = messages[-1] if messages else None
            if last is not None and last.role == "assistant":
                last.tool_calls = [*(last.tool_calls or []), call]
            else:
                messages.append(ChatMessage(role="assistant", content=None, tool_calls=[call]))
        else:
            output = item.output if isinstance(item.output, str) else "\n".join(
                p.text for p in item.output)
            messages.append(ChatMessage(role="tool", content=output,
                                        tool_call_id=item.call_id))
    return messages


def chat_tools(body: ResponsesRequest) -> tuple[list[ChatTool] | None, ToolChoice | None]:
    """Function tools and tool_choice in the chat API's shape."""
    tools = None
    if body.tools is not None:
        tools = []
        for i, t in enumerate(body.tools):
            if t.get("type") != "function" or not isinstance(t.get("name"), str):
                raise bad_request(f"only function tools are supported (type 'function' with a "
                                  f"name), got type {t.get('type')!r}", f"tools[{i}]")
            tools.append(ChatTool(function=FunctionDefinition(
                name=t["name"], description=t.get("description"),
                parameters=t.get("parameters"), strict=t.get("strict"))))
    choice = body.tool_choice
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise bad_request("tool_choice must be auto, none, required or {\"type\": "
                              "\"function\", \"name\": ...}", "tool_choice")
        return tools, NamedToolChoice(function=FunctionName(name=choice["name"]))
    if choice not in (None, "auto", "none", "required"):
        raise bad_request(f"tool_choice {choice!r} is not one of auto, none, required",
                          "tool_choice")
    return tools, choice


# -- the response ---------------------------------------------------------------------------
class OutputText(Struct, tag="output_text", tag_field="type"):
    text: str
    annotations: list[Any] = []
    logprobs: list[Any] = []


class OutputMessage(Struct, tag="message", tag_field="type"):
    id: str
    status: str
    content: list[OutputText]
    role: str = "assistant"


class ReasoningText(Struct, tag="reasoning_text", tag_field="type"):
    text: str


class ReasoningItem(Struct, tag="reasoning", tag_field="type"):
    """The thinking span (--reasoning-parser), before the message: its text in ``content``
    (``summary`` stays empty: the model wrote no summary), as vLLM sends it."""

    id: str
    status: str
    content: list[ReasoningText]
    summary: list[Any] = []


class FunctionCallItem(Struct, tag="function_call", tag_field="type"):
    id: str
    call_id: str
    name: str
    arguments: str
    status: str


class InputTokensDetails(Struct):
    cached_tokens: int = 0


class OutputTokensDetails(Struct):
    reasoning_tokens: int = 0


class ResponseUsage(Struct):
    input_tokens: int
    output_tokens: int
    total_tokens: int
    input_tokens_details: InputTokensDetails = field(default_factory=InputTokensDetails)
    output_tokens_details: OutputTokensDetails = field(default_factory=OutputTokensDetails)


class IncompleteDetails(Struct):
    reason: str


class ResponseObject(Struct):
    id: str
    created_at: int
    model: str
    status: str
    output: list[ReasoningItem | OutputMessage | FunctionCallItem]
    tools: list[dict[str, Any]]
    tool_choice: str | dict[str, Any]
    parallel_tool_calls: bool
    usage: ResponseUsage | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    text: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None
    error: Any = None
    previous_response_id: str | None = None
    store: bool = False
    truncation: str = "disabled"
    object: str = "response"


class ResponseStreamEvent(Struct, kw_only=True, omit_defaults=True):
    """One streamed event (``event: <type>``); the fields its ``type`` uses are set."""

    type: str
    sequence_number: int
    response: ResponseObject | None = None
    output_index: int | None = None
    content_index: int | None = None
    item_id: str | None = None
    item: ReasoningItem | OutputMessage | FunctionCallItem | None = None
    part: OutputText | ReasoningText | None = None
    delta: str | None = None
    text: str | None = None
    name: str | None = None
    arguments: str | None = None
    logprobs: list[Any] | None = None
