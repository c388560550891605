"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API over the chat
template, so tools written for Anthropic's API (coding agents among them) run against a local
model, as vLLM and llama-server serve it.

The request is turned into chat messages (``messages_protocol.chat_messages``) and rendered
with the chat template; ``tools``/``tool_choice`` follow the chat API's rules (``tools.py``:
``auto`` reads calls with ``--tool-call-parser``, ``any`` and ``tool`` force them through a
grammar); with ``--reasoning-parser`` the thinking span is a ``thinking`` block before the
answer, and ``thinking: {"type": "enabled", "budget_tokens": N}`` is the thinking budget
(``thinking`` also sets the template switches ``enable_thinking`` and ``thinking``).

Streamed, the events are Anthropic's: ``message_start``, ``ping``, per block
``content_block_start``, ``content_block_delta`` (``text_delta``, ``thinking_delta``,
``input_json_delta``), ``content_block_stop``, then ``message_delta`` (stop reason, output
tokens) and ``message_stop``, each as ``event: <type>`` and ``data: <json>``.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from aiohttp import web

from asyncengine.core.sampling_params import SamplingParams, StructuredOutputsParams
from asyncengine.engine.outputs import CompletionOutput, RequestOutput
from asyncengine.entrypoints.http.anthropic.protocol import (
    Block,
    ContentBlockDelta,
    ContentBlockStart,
    ContentBlockStop,
    CountTokensRequest,
    CountTokensResponse,
    InputJsonDelta,
    MessageDelta,
    MessageDeltaBody,
    MessageDeltaUsage,
    MessageObject,
    MessagesBase,
    MessagesRequest,
    MessageStart,
    MessageStop,
    MessagesUsage,
    Ping,
    TextBlock,
    TextDelta,
    ThinkingBlock,
    ThinkingDelta,
    ThinkingDisabled,
    ThinkingEnabled,
    ToolUseBlock,
    chat_messages,
    chat_tools,
)
from asyncengine.entrypoints.http.errors import APIError, bad_request, from_value_error
from asyncengine.entrypoints.http.images import chat_prompt, counted_ids
from asyncengine.entrypoints.http.openai.chat import render_chat
from asyncengine.entrypoints.http.params import KNOWN_PARAMS
from asyncengine.entrypoints.http.protocol import ChatMessage
from asyncengine.entrypoints.http.reasoning import (
    ReasoningPlan,
    chat_template_kwargs,
    plan_reasoning,
)
from asyncengine.entrypoints.http.serving import (
    aborted,
    check_model,
    collect,
    json_response,
    open_streams,
    read_body,
    request_id,
    run_sse,
)
from asyncengine.entrypoints.http.sse import ClientGone, SSEStream, encode_json
from asyncengine.entrypoints.http.state import ServerState, state_of
from asyncengine.entrypoints.http.tools import ToolPlan, plan_tools
from asyncengine.text.tool_parsers import ParsedDelta


def _render(state: ServerState, body: MessagesBase) -> tuple[str, ToolPlan, list[ChatMessage]]:
    tools, choice, parallel = chat_tools(body)
    plan = plan_tools(tools, choice, parallel, state.settings)
    kwargs = chat_template_kwargs(state, None)
    if body.thinking is not None:  # the templates' thinking switches (Qwen3, DeepSeek-V3.1)
        on = not isinstance(body.thinking, ThinkingDisabled)
        kwargs.update(enable_thinking=on, thinking=on)
    messages = chat_messages(body)
    text = render_chat(state.engine, messages, tools=plan.template_tools,
                       template_kwargs=kwargs)
    return text, plan, messages


async def count_tokens(request: web.Request) -> web.Response:
    state = state_of(request)
    body = await read_body(request, CountTokensRequest)
    check_model(state.engine, body.model)
    text, _, messages = _render(state, body)
    ids = await counted_ids(state.engine, messages, text)
    return json_response(CountTokensResponse(len(ids)))


async def create_message(request: web.Request) -> web.StreamResponse:
    state = state_of(request)
    engine = state.engine
    body = await read_body(request, MessagesRequest)
    check_model(engine, body.model)
    text, plan, messages = _render(state, body)
    reasoning = plan_reasoning(state, text)
    budget = None
    if isinstance(body.thinking, ThinkingEnabled):
        budget = body.thinking.budget_tokens
        if not reasoning.configured:
            raise bad_request("thinking needs a reasoning model served with "
                              "--reasoning-parser", "thinking")
    prompt = engine.tokenizer.encode(text, add_special_tokens=False)
    call = _Message(state, request_id(request, "msg").replace("msg-", "msg_", 1), plan,
                    reasoning)
    structured = plan.structured_outputs
    fmt = body.output_config.format if body.output_config is not None else None
    if fmt is not None:
        if structured is not None:
            raise bad_request("output_config.format cannot be combined with tool_choice any "
                              "or tool", "output_config")
        try:
            structured = StructuredOutputsParams(json=fmt.schema_)
        except ValueError as e:
            raise bad_request(f"output_config.format: {e}", "output_config") from None
    d = state.generation_defaults
    try:
        params = SamplingParams(
            temperature=d.get("temperature", 1.0) if body.temperature is None
            else body.temperature,
            top_p=d.get("top_p", 1.0) if body.top_p is None else body.top_p,
            top_k=d.get("top_k", 0) if body.top_k is None else body.top_k,
            min_p=d.get("min_p", 0.0), repetition_penalty=d.get("repetition_penalty", 1.0),
            max_tokens=body.max_tokens or None, stop=list(body.stop_sequences or []),
            structured_outputs=structured)
        params.validate(engine.sampling_limits)
    except ValueError as e:
        raise from_value_error(e, KNOWN_PARAMS) from None
    try:
        reasoning.apply(params, budget, "thinking.budget_tokens")
    except APIError as e:
        raise bad_request(e.message, "thinking") from None
    if body.max_tokens == 0:  # Anthropic's cache warm-up: checked as any request, not run
        return await call.empty(request, len(prompt), bool(body.stream))
    engine_prompt = await chat_prompt(engine, messages, prompt, text)
    streams = await open_streams(engine, [engine_prompt], params, call.id, 0,
                                 deltas_only=bool(body.stream))
    if body.stream:
        return await run_sse(request, streams, call.render, call.on_end, done_marker=False,
                             render_error=_error_event)
    return json_response(call.final((await collect(streams))[0]))


def _error_event(error: APIError) -> bytes:
    return b"event: error\ndata: " + encode_json(error.anthropic_body()) + b"\n\n"


_EVENTS: dict[str, type] = {
    "message_start": MessageStart, "ping": Ping, "content_block_start": ContentBlockStart,
    "content_block_delta": ContentBlockDelta, "content_block_stop": ContentBlockStop,
    "message_delta": MessageDelta, "message_stop": MessageStop}


def _tool_id() -> str:
    return f"toolu_{uuid.uuid4().hex[:24]}"


def _input(arguments: str) -> dict[str, Any]:
    try:
        value = json.loads(arguments) if arguments else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _stop(c: CompletionOutput, made_calls: bool) -> tuple[str | None, str | None]:
    """Anthropic's stop_reason and stop_sequence for a finished sample."""
    if c.finish_reason == "length":
        return "max_tokens", None
    if made_calls:
        return "tool_use", None
    if isinstance(c.stop_reason, str):
        return "stop_sequence", c.stop_reason
    return "end_turn", None


class _Message:
    """One call: the message object, or the events of its stream."""

    def __init__(self, state: ServerState, id: str, plan: ToolPlan,
                 reasoning: ReasoningPlan) -> None:
        self.id = id
        self.engine = state.engine  # (its aborts' reason)
        self.model = state.engine.model_name
        self.plan = plan
        self.reasoning = reasoning
        self.thinker = reasoning.make()
        self.parser = plan.make_parser() if plan.make_parser is not None else None
        self.started = False
        self.index = -1  # the open block's index
        self.open: str | None = None  # its kind: thinking | text | tool:<n>

    # -- non-streaming --------------------------------------------------------------------------
    def final(self, out: RequestOutput) -> MessageObject:
        c = out.outputs[0]
        if c.finish_reason == "abort":
            raise aborted(self.engine)
        blocks: list[Block] = []
        answer = c.text
        if self.thinker is not None:
            split = self.thinker.parse(c.text)
            answer = split.content or ""
            if split.reasoning is not None:
                blocks.append(ThinkingBlock(split.reasoning))
        parsed = self.plan.parse(answer)
        text = (parsed.content or "") if parsed.calls else answer
        if text:
            blocks.append(TextBlock(text))
        blocks += [ToolUseBlock(_tool_id(), t.name, _input(t.arguments)) for t in parsed.calls]
        stop_reason, stop_sequence = _stop(c, bool(parsed.calls))
        return MessageObject(self.id, self.model, blocks, stop_reason, stop_sequence,
                             MessagesUsage(len(out.prompt_token_ids), c.num_output_tokens))

    async def empty(self, request: web.Request, n_in: int, stream: bool) -> web.StreamResponse:
        """``max_tokens: 0``: a message with no content."""
        message = MessageObject(self.id, self.model, [], "max_tokens", None,
                                MessagesUsage(n_in, 0))
        if not stream:
            return json_response(message)
        sse = await SSEStream.open(request, done_marker=False)
        try:
            await sse.write(self._event("message_start", message=message)
                            + self._event("message_delta",
                                          delta=MessageDeltaBody("max_tokens", None),
                                          usage=MessageDeltaUsage(0))
                            + self._event("message_stop"))
            await sse.done()
        except ClientGone:
            pass
        finally:
            sse.release()
        return sse.response

    # -- streaming ------------------------------------------------------------------------------
    def _event(self, type_: str, **fields: Any) -> bytes:
        ev = _EVENTS[type_](**fields)
        return b"event: " + type_.encode() + b"\ndata: " + encode_json(ev) + b"\n\n"

    def _block(self, kind: str, block: Block) -> bytes:
        """Close the open block if it is another, open ``block`` as ``kind``."""
        if self.open == kind:
            return b""
        data = self._close_block()
        self.index += 1
        self.open = kind
        return data + self._event("content_block_start", index=self.index, content_block=block)

    def _close_block(self) -> bytes:
        if self.open is None:
            return b""
        self.open = None
        return self._event("content_block_stop", index=self.index)

    def render(self, i: int, out: RequestOutput) -> bytes:
        data = b""
        c = out.outputs[0]
        if c.finish_reason == "abort":
            raise aborted(self.engine)
        if not self.started:
            self.started = True
            start = MessageObject(self.id, self.model, [], None, None,
                                  MessagesUsage(len(out.prompt_token_ids), 0))
            data += self._event("message_start", message=start) + self._event("ping")
        last = c.finish_reason is not None
        text = c.delta_text
        if self.thinker is not None:
            split = self.thinker.feed(text)
            if last:
                split.extend(self.thinker.finish())
            if split.reasoning:
                data += self._block("thinking", ThinkingBlock(""))
                data += self._event("content_block_delta", index=self.index,
                                    delta=ThinkingDelta(split.reasoning))
            text = split.content
        if self.parser is None:
            parsed = ParsedDelta(content=text)
        else:
            parsed = self.parser.feed(text)
            if last:
                parsed.extend(self.parser.finish())
        if parsed.content:
            data += self._block("text", TextBlock(""))
            data += self._event("content_block_delta", index=self.index,
                                delta=TextDelta(parsed.content))
        for piece in parsed.calls:
            if piece.name is not None:
                data += self._block(f"tool:{piece.index}",
                                    ToolUseBlock(_tool_id(), piece.name, {}))
            if piece.arguments:
                data += self._event("content_block_delta", index=self.index,
                                    delta=InputJsonDelta(piece.arguments))
        if last:
            data += self._close_block()
            made_calls = self.parser is not None and self.parser.made_calls
            stop_reason, stop_sequence = _stop(c, made_calls)
            data += self._event("message_delta", delta=MessageDeltaBody(stop_reason,
                                                                        stop_sequence),
                                usage=MessageDeltaUsage(c.num_output_tokens))
        return data

    async def on_end(self, sse: SSEStream) -> None:
        await sse.write(self._event("message_stop"))
