"""Anthropic's Messages API (``POST /v1/messages``, ``/v1/messages/count_tokens``): the
request and response bodies, the stream's events, and the conversion of a conversation to chat
messages for the chat template.

Content blocks are read by their ``type``: ``text``, ``tool_use`` (a call the assistant made),
``tool_result`` (its result, in a user turn), ``thinking`` / ``redacted_thinking`` (an earlier
turn's reasoning: dropped, as chat templates drop it), ``image`` (base64 or url: for a
vision-language model, ``entrypoints/http/images.py``). Anything else (documents) is a 400
naming it.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from msgspec import Meta, Struct, field

from asyncengine.entrypoints.http.errors import bad_request
from asyncengine.entrypoints.http.protocol import (
    Body,
    ChatMessage,
    ChatTool,
    FunctionCall,
    FunctionDefinition,
    FunctionName,
    ImageURLPart,
    NamedToolChoice,
    TextPart,
    TokenCount,
    ToolCall,
    ToolChoice,
)


# -- content blocks in a request ---------------------------------------------------------------
class TextBlockIn(Body, kw_only=True, tag="text", tag_field="type"):
    text: str


class ToolUseBlockIn(Body, kw_only=True, tag="tool_use", tag_field="type"):
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlockIn(Body, kw_only=True, tag="tool_result", tag_field="type"):
    tool_use_id: str
    content: str | list[TextBlockIn] | None = None
    is_error: bool | None = None


class ThinkingBlockIn(Body, kw_only=True, tag="thinking", tag_field="type"):
    thinking: str
    signature: str | None = None


class RedactedThinkingBlockIn(Body, kw_only=True, tag="redacted_thinking", tag_field="type"):
    data: str


class Base64Source(Body, kw_only=True, tag="base64", tag_field="type"):
    media_type: str
    data: str


class URLSource(Body, kw_only=True, tag="url", tag_field="type"):
    url: str


class ImageBlockIn(Body, kw_only=True, tag="image", tag_field="type"):
    source: Base64Source | URLSource

    @property
    def url(self) -> str:
        src = self.source
        return src.url if isinstance(src, URLSource) else \
            f"data:{src.media_type};base64,{src.data}"


BlockIn = (TextBlockIn | ImageBlockIn | ToolUseBlockIn | ToolResultBlockIn | ThinkingBlockIn
           | RedactedThinkingBlockIn)


class MessageIn(Body, kw_only=True):
    role: Literal["user", "assistant"]
    content: str | list[BlockIn]


class Tool(Body, kw_only=True):
    name: str
    input_schema: dict[str, Any]
    description: str | None = None
    type: Literal["custom"] | None = None  # server tools (web search...) are refused


class ToolChoiceAuto(Body, kw_only=True, tag="auto", tag_field="type"):
    disable_parallel_tool_use: bool | None = None


class ToolChoiceAny(Body, kw_only=True, tag="any", tag_field="type"):
    disable_parallel_tool_use: bool | None = None


class ToolChoiceTool(Body, kw_only=True, tag="tool", tag_field="type"):
    name: str
    disable_parallel_tool_use: bool | None = None


class ToolChoiceNone(Body, kw_only=True, tag="none", tag_field="type"):
    pass


AnthropicToolChoice = ToolChoiceAuto | ToolChoiceAny | ToolChoiceTool | ToolChoiceNone


class ThinkingEnabled(Body, kw_only=True, tag="enabled", tag_field="type"):
    budget_tokens: TokenCount


class ThinkingDisabled(Body, kw_only=True, tag="disabled", tag_field="type"):
    pass


class ThinkingAdaptive(Body, kw_only=True, tag="adaptive", tag_field="type"):
    """The model decides how much to think: thinking on, no budget."""

    display: str | None = None


Thinking = ThinkingEnabled | ThinkingDisabled | ThinkingAdaptive


class JsonOutputFormat(Body, kw_only=True, tag="json_schema", tag_field="type"):
    schema_: dict[str, Any] = field(name="schema")


class OutputConfig(Body, kw_only=True):
    format: JsonOutputFormat | None = None  # structured outputs (on the answer only)
    effort: str | None = None  # accepted, not used


class MessagesBase(Body, kw_only=True):
    model: str | None = None
    messages: Annotated[list[MessageIn], Meta(min_length=1)]
    system: str | list[TextBlockIn] | None = None
    tools: Annotated[list[Tool], Meta(min_length=1)] | None = None
    tool_choice: AnthropicToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None


class MessagesRequest(MessagesBase, kw_only=True):
    """POST /v1/messages. ``max_tokens: 0`` generates nothing (Anthropic's cache warm-up).
    ``temperature``, ``top_p`` and ``top_k`` are the older API's (and vLLM's): accepted."""

    max_tokens: TokenCount
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stop_sequences: list[str] | None = None
    stream: bool | None = None
    metadata: dict[str, Any] | None = None


class CountTokensRequest(MessagesBase, kw_only=True):
    """POST /v1/messages/count_tokens."""


# -- the conversation as chat messages -----------------------------------------------------------
def chat_messages(body: MessagesBase) -> list[ChatMessage]:
    """``system``, then each turn: a user turn's tool results become tool messages (before
    its text), an assistant turn's tool_use blocks its tool calls."""
    messages: list[ChatMessage] = []
    if body.system:
        system = body.system if isinstance(body.system, str) else "\n".join(
            b.text for b in body.system)
        messages.append(ChatMessage(role="system", content=system))
    if not body.messages:
        raise bad_request("messages: at least one message is required", "messages")
    for i, m in enumerate(body.messages):
        if isinstance(m.content, str):
            messages.append(ChatMessage(role=m.role, content=m.content))
            continue
        texts: list[TextPart | ImageURLPart] = []
        calls = []
        for j, block in enumerate(m.content):
            if isinstance(block, TextBlockIn):
                texts.append(TextPart(text=block.text))
            elif isinstance(block, ImageBlockIn):
                texts.append(ImageURLPart(image_url=block.url))
            elif isinstance(block, ToolUseBlockIn):
                if m.role != "assistant":
                    raise bad_request("tool_use blocks belong to assistant turns",
                                      f"messages[{i}].content[{j}]")
                calls.append(ToolCall(id=block.id, function=FunctionCall(
                    name=block.name, arguments=block.input)))
            elif isinstance(block, ToolResultBlockIn):
                if m.role != "user":
                    raise bad_request("tool_result blocks belong to user turns",
                                      f"messages[{i}].content[{j}]")
                content = block.content
                if isinstance(content, list):
                    content = "\n".join(b.text for b in content)
                messages.append(ChatMessage(role="tool", content=content or "",
                                            tool_call_id=block.tool_use_id))
            # thinking / redacted_thinking: an earlier turn's reasoning, dropped
        results = any(isinstance(b, ToolResultBlockIn) for b in m.content)
        if texts or calls or m.role == "assistant" or not results:  # a turn, even if empty
            content: str | list[TextPart | ImageURLPart] | None = texts
            if not any(isinstance(p, ImageURLPart) for p in texts):
                content = "\n".join(p.text for p in texts)  # type: ignore[union-attr]
            messages.append(ChatMessage(role=m.role, content=content or (
                None if calls else ""), tool_calls=calls or None))
    return messages


def chat_tools(body: MessagesBase) -> tuple[list[ChatTool] | None, ToolChoice | None,
                                            bool | None]:
    """Tools, tool_choice and parallel_tool_calls in the chat API's shape."""
    tools = None
    if body.tools is not None:
        tools = []
        for i, t in enumerate(body.tools):
            if t.type not in (None, "custom"):
                raise bad_request(f"tool type {t.type!r} is not supported (only custom tools "
                                  "with an input_schema)", f"tools[{i}].type")
            tools.append(ChatTool(function=FunctionDefinition(
                name=t.name, description=t.description, parameters=t.input_schema)))
    c = body.tool_choice
    parallel = None if c is None or isinstance(c, ToolChoiceNone) else \
        (False if c.disable_parallel_tool_use else None)
    if c is None:
        return tools, None, parallel
    if isinstance(c, ToolChoiceNone):
        return tools, "none", parallel
    if isinstance(c, ToolChoiceAny):
        return tools, "required", parallel
    if isinstance(c, ToolChoiceTool):
        return tools, NamedToolChoice(function=FunctionName(name=c.name)), parallel
    return tools, "auto", parallel


# -- the response --------------------------------------------------------------------------------
class TextBlock(Struct, tag="text", tag_field="type"):
    text: str


class ThinkingBlock(Struct, tag="thinking", tag_field="type"):
    thinking: str
    signature: str = ""  # this server signs nothing


class ToolUseBlock(Struct, tag="tool_use", tag_field="type"):
    id: str
    name: str
    input: dict[str, Any]


Block = ThinkingBlock | TextBlock | ToolUseBlock


class MessagesUsage(Struct):
    input_tokens: int
    output_tokens: int


class MessageObject(Struct, tag="message", tag_field="type"):
    id: str
    model: str
    content: list[Block]
    stop_reason: str | None
    stop_sequence: str | None
    usage: MessagesUsage
    role: str = "assistant"


class CountTokensResponse(Struct):
    input_tokens: int


class TextDelta(Struct, tag="text_delta", tag_field="type"):
    text: str


class ThinkingDelta(Struct, tag="thinking_delta", tag_field="type"):
    thinking: str


class SignatureDelta(Struct, tag="signature_delta", tag_field="type"):
    signature: str


class InputJsonDelta(Struct, tag="input_json_delta", tag_field="type"):
    partial_json: str


class MessageDeltaBody(Struct):
    stop_reason: str | None
    stop_sequence: str | None


class MessageDeltaUsage(Struct):
    output_tokens: int


class MessageStart(Struct, tag="message_start", tag_field="type"):
    message: MessageObject


class Ping(Struct, tag="ping", tag_field="type"):
    pass


class ContentBlockStart(Struct, tag="content_block_start", tag_field="type"):
    index: int
    content_block: Block


class ContentBlockDelta(Struct, tag="content_block_delta", tag_field="type"):
    index: int
    delta: TextDelta | ThinkingDelta | SignatureDelta | InputJsonDelta


class ContentBlockStop(Struct, tag="content_block_stop", tag_field="type"):
    index: int


class MessageDelta(Struct, tag="message_delta", tag_field="type"):
    delta: MessageDeltaBody
    usage: MessageDeltaUsage


class MessageStop(Struct, tag="message_stop", tag_field="type"):
    pass


#: One streamed event (``event: <type>``, ``data:`` this with the same ``type``).
MessagesStreamEvent = (MessageStart | Ping | ContentBlockStart | ContentBlockDelta
                       | ContentBlockStop | MessageDelta | MessageStop)


class AnthropicErrorInfo(Struct):
    type: str
    message: str


class AnthropicError(Struct, tag="error", tag_field="type"):
    """Anthropic's error body: ``{"type": "error", "error": {"type", "message"}}``."""

    error: AnthropicErrorInfo
