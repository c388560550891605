"""POST /v1/responses: OpenAI's Responses API, stateless, over the chat template.

``input`` (a string or items), ``instructions``, ``max_output_tokens``, ``temperature``,
``top_p``, ``text.format`` (JSON schema / object) and function ``tools`` with
``tool_choice`` (as in chat: see ``tools.py``). Streamed, the events are OpenAI's:
``response.created``, ``response.in_progress``, then per output item
``response.output_item.added``, ``response.content_part.added``,
``response.output_text.delta`` ... ``.done``, ``response.content_part.done``,
``response.output_item.done`` (function calls: ``response.function_call_arguments.delta`` /
``.done``), and ``response.completed`` (its response's ``status`` is ``incomplete`` when
``max_output_tokens`` cut it short), each as ``event: <type>`` and ``data: <json>`` with a
``sequence_number``.

With ``--reasoning-parser``, the thinking span is a ``reasoning`` item (its text in
``content`` as ``reasoning_text``) before the message; streamed, its text comes as
``response.reasoning_text.delta`` / ``.done`` events inside its own item.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from aiohttp import web

from asyncengine.core.sampling_params import SamplingParams, StructuredOutputsParams
from asyncengine.engine.outputs import RequestOutput
from asyncengine.entrypoints.http.errors import bad_request, from_value_error
from asyncengine.entrypoints.http.images import chat_prompt
from asyncengine.entrypoints.http.openai.chat import default_max_tokens, render_chat
from asyncengine.entrypoints.http.openai.file_images import resolve_file_images
from asyncengine.entrypoints.http.openai.responses_protocol import (
    FunctionCallItem,
    IncompleteDetails,
    InputTokensDetails,
    OutputMessage,
    OutputText,
    OutputTokensDetails,
    ReasoningItem,
    ReasoningText,
    ResponseObject,
    ResponsesRequest,
    ResponseStreamEvent,
    ResponseUsage,
    chat_messages,
    chat_tools,
    refused,
)
from asyncengine.entrypoints.http.params import KNOWN_PARAMS
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
from asyncengine.entrypoints.http.sse import SSEStream, encode_json
from asyncengine.entrypoints.http.state import ServerState, state_of
from asyncengine.entrypoints.http.tools import (
    ToolPlan,
    check_no_other_format,
    plan_tools,
    tool_call_id,
)
from asyncengine.text.tool_parsers import ParsedDelta


async def create_response(request: web.Request) -> web.StreamResponse:
    state = state_of(request)
    engine = state.engine
    body = await read_body(request, ResponsesRequest)
    lora = check_model(engine, body.model)
    refused(body)
    await resolve_file_images(request, body.input, engine)  # (input_image by file_id)
    tools, choice = chat_tools(body)
    plan = plan_tools(tools, choice, body.parallel_tool_calls, state.settings)
    fmt = _text_format(body)
    check_no_other_format(plan, fmt)
    messages = chat_messages(body)
    text = render_chat(engine, messages, tools=plan.template_tools,
                       template_kwargs=chat_template_kwargs(state, None))
    reasoning = plan_reasoning(state, text)
    prompt = engine.tokenizer.encode(text, add_special_tokens=False)
    max_tokens = body.max_output_tokens
    if max_tokens is None:
        max_tokens = default_max_tokens(state, len(prompt))
    d = state.generation_defaults
    try:
        params = SamplingParams(
            temperature=d.get("temperature", 1.0) if body.temperature is None
            else body.temperature,
            top_p=d.get("top_p", 1.0) if body.top_p is None else body.top_p,
            top_k=d.get("top_k", 0), min_p=d.get("min_p", 0.0),
            repetition_penalty=d.get("repetition_penalty", 1.0), max_tokens=max_tokens,
            structured_outputs=plan.structured_outputs or fmt)
    except ValueError as e:
        err = from_value_error(e, KNOWN_PARAMS)
        if err.param == "max_tokens":  # this API's name for it
            err = bad_request(err.message.replace("max_tokens", "max_output_tokens"),
                              "max_output_tokens")
        raise err from None
    reasoning.apply(params, body.thinking_token_budget, "thinking_token_budget")
    call = _Response(state, body, request_id(request, "resp"), plan, reasoning)
    if lora is not None:  # responses name the adapter
        call.model = lora
    engine_prompt = await chat_prompt(engine, messages, prompt, text)
    streams = await open_streams(engine, [engine_prompt], params, call.id, 0,
                                 deltas_only=bool(body.stream), lora_name=lora)
    if body.stream:
        return await run_sse(request, streams, call.render, call.on_end, done_marker=False)
    return json_response(call.final((await collect(streams))[0]))


def _text_format(body: ResponsesRequest) -> StructuredOutputsParams | None:
    fmt = body.text.format if body.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    if fmt.schema_ is None:
        raise bad_request("text.format.schema is required for json_schema", "text.format")
    try:
        return StructuredOutputsParams(json=fmt.schema_)
    except ValueError as e:
        raise bad_request(f"text.format: {e}", "text.format") from None


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class _Response:
    """One response: the final object, or the events of its stream."""

    def __init__(self, state: ServerState, body: ResponsesRequest, id: str,
                 plan: ToolPlan, reasoning: ReasoningPlan | None = None) -> None:
        self.id = id
        self.engine = state.engine  # (its aborts' reason)
        self.body = body
        self.plan = plan
        self.model = state.engine.model_name
        self.created = int(time.time())
        self.seq = 0
        self.output: list[ReasoningItem | OutputMessage | FunctionCallItem] = []
        self.message: OutputMessage | None = None  # the open message item, while streaming
        self.reasoning = reasoning or ReasoningPlan()
        self.thinker = self.reasoning.make()
        self.thought: ReasoningItem | None = None  # the open reasoning item, while streaming
        self.output_ids: list[int] = []  # streaming, reasoning: to count it
        self.calls: dict[int, FunctionCallItem] = {}  # the parser's call index -> its item
        self.parser = plan.make_parser() if plan.make_parser is not None else None
        self.started = False
        self.status = "in_progress"
        self.incomplete: IncompleteDetails | None = None
        self.usage: ResponseUsage | None = None

    def response(self) -> ResponseObject:
        b = self.body
        fmt = b.text.format if b.text is not None and b.text.format is not None else None
        return ResponseObject(
            id=self.id, created_at=self.created, model=self.model, status=self.status,
            output=list(self.output), tools=b.tools or [], tool_choice=_choice(b),
            parallel_tool_calls=b.parallel_tool_calls is not False, usage=self.usage,
            incomplete_details=self.incomplete, instructions=b.instructions,
            max_output_tokens=b.max_output_tokens, temperature=b.temperature, top_p=b.top_p,
            text={"format": {"type": fmt.type if fmt else "text"}}, metadata=b.metadata)

    def _finish(self, out: RequestOutput) -> None:
        c = out.outputs[0]
        if c.finish_reason == "abort":
            raise aborted(self.engine)
        n_in, n_out = len(out.prompt_token_ids), c.num_output_tokens
        ids = c.token_ids if len(c.token_ids) == n_out else self.output_ids
        self.usage = ResponseUsage(  # cached: the prompt's tokens found in the prefix cache
            n_in, n_out, n_in + n_out, InputTokensDetails(out.num_cached_tokens or 0),
            OutputTokensDetails(self.reasoning.count(ids)))
        if c.finish_reason == "length":
            self.status, self.incomplete = "incomplete", IncompleteDetails("max_output_tokens")
        else:
            self.status = "completed"

    # -- non-streaming --------------------------------------------------------------------------
    def final(self, out: RequestOutput) -> ResponseObject:
        self._finish(out)
        answer = out.outputs[0].text
        done = "completed" if self.status == "completed" else "incomplete"
        if self.thinker is not None:
            split = self.thinker.parse(answer)
            answer = split.content or ""
            if split.reasoning is not None:
                self.output.append(ReasoningItem(_item_id("rs"), done,
                                                 [ReasoningText(split.reasoning)]))
        parsed = self.plan.parse(answer)
        thought_only = bool(self.output) and not parsed.content and not parsed.calls
        if (parsed.content is not None or not parsed.calls) and not thought_only:
            self.output.append(OutputMessage(_item_id("msg"), done,
                                             [OutputText(parsed.content or "")]))
        for call in parsed.calls:
            self.output.append(FunctionCallItem(_item_id("fc"), tool_call_id(), call.name,
                                                call.arguments, done))
        return self.response()

    # -- streaming ------------------------------------------------------------------------------
    def _event(self, type_: str, **fields: Any) -> bytes:
        event = ResponseStreamEvent(type=type_, sequence_number=self.seq, **fields)
        self.seq += 1
        return b"event: " + type_.encode() + b"\ndata: " + encode_json(event) + b"\n\n"

    def render(self, i: int, out: RequestOutput) -> bytes:
        """The events for one streamed output (deltas only)."""
        data = b""
        if not self.started:
            self.started = True
            data += self._event("response.created", response=self.response())
            data += self._event("response.in_progress", response=self.response())
        c = out.outputs[0]
        last = c.finish_reason is not None
        text = c.delta_text
        if self.thinker is not None:
            self.output_ids += c.delta_token_ids
            split = self.thinker.feed(text)
            if last:
                split.extend(self.thinker.finish())
            if split.reasoning:
                data += self._reasoning(split.reasoning)
            text = split.content
        if last:
            self._finish(out)
        if self.parser is None:
            parsed = ParsedDelta(content=text)
        else:
            parsed = self.parser.feed(text)
            if last:
                parsed.extend(self.parser.finish())
        if parsed.content:
            data += self._text(parsed.content)
        for piece in parsed.calls:
            data += self._call(piece.index, piece.name, piece.arguments)
        if last:
            data += self._close_all()
        return data

    def _reasoning(self, delta: str) -> bytes:
        data = b""
        if self.thought is None:
            self.thought = ReasoningItem(_item_id("rs"), "in_progress", [])
            self.output.append(self.thought)
            index = len(self.output) - 1
            data += self._event("response.output_item.added", output_index=index,
                                item=self.thought)
            data += self._event("response.content_part.added", item_id=self.thought.id,
                                output_index=index, content_index=0, part=ReasoningText(""))
            self.thought.content.append(ReasoningText(""))
        self.thought.content[0].text += delta
        return data + self._event("response.reasoning_text.delta", item_id=self.thought.id,
                                  output_index=self.output.index(self.thought),
                                  content_index=0, delta=delta)

    def _close_reasoning(self) -> bytes:
        r, self.thought = self.thought, None
        if r is None:
            return b""
        index = self.output.index(r)
        part = r.content[0]
        r.status = "completed" if self.status != "incomplete" or self.message is not None \
            or self.calls else "incomplete"
        return (self._event("response.reasoning_text.done", item_id=r.id, output_index=index,
                            content_index=0, text=part.text)
                + self._event("response.content_part.done", item_id=r.id, output_index=index,
                              content_index=0, part=part)
                + self._event("response.output_item.done", output_index=index, item=r))

    def _text(self, delta: str) -> bytes:
        data = b""
        if self.message is None:
            data += self._close_reasoning()
            self.message = OutputMessage(_item_id("msg"), "in_progress", [])
            self.output.append(self.message)
            index = len(self.output) - 1
            data += self._event("response.output_item.added", output_index=index,
                                item=self.message)
            data += self._event("response.content_part.added", item_id=self.message.id,
                                output_index=index, content_index=0, part=OutputText(""))
            self.message.content.append(OutputText(""))
        if not delta:
            return data
        self.message.content[0].text += delta
        return data + self._event("response.output_text.delta", item_id=self.message.id,
                                  output_index=self.output.index(self.message),
                                  content_index=0, delta=delta, logprobs=[])

    def _close_message(self) -> bytes:
        m, self.message = self.message, None
        if m is None:
            return b""
        index = self.output.index(m)
        part = m.content[0]
        m.status = "completed" if self.status != "incomplete" else "incomplete"
        return (self._event("response.output_text.done", item_id=m.id, output_index=index,
                            content_index=0, text=part.text, logprobs=[])
                + self._event("response.content_part.done", item_id=m.id, output_index=index,
                              content_index=0, part=part)
                + self._event("response.output_item.done", output_index=index, item=m))

    def _call(self, index: int, name: str | None, arguments: str) -> bytes:
        data = b""
        item = self.calls.get(index)
        if item is None:
            data += self._close_reasoning() + self._close_message()
            item = self.calls[index] = FunctionCallItem(_item_id("fc"), tool_call_id(),
                                                        name or "", "", "in_progress")
            self.output.append(item)
            data += self._event("response.output_item.added",
                                output_index=len(self.output) - 1, item=item)
        if arguments:
            item.arguments += arguments
            data += self._event("response.function_call_arguments.delta", item_id=item.id,
                                output_index=self.output.index(item), delta=arguments)
        return data

    def _close_all(self) -> bytes:
        data = b""
        if not self.output:  # nothing was generated: an empty message, as OpenAI sends
            data += self._text("")
        data += self._close_reasoning() + self._close_message()
        for item in self.calls.values():
            index = self.output.index(item)
            item.status = "completed" if self.status != "incomplete" else "incomplete"
            data += self._event("response.function_call_arguments.done", item_id=item.id,
                                output_index=index, name=item.name, arguments=item.arguments)
            data += self._event("response.output_item.done", output_index=index, item=item)
        return data

    async def on_end(self, sse: SSEStream) -> None:
        # Always "response.completed" (the response's status says "incomplete" when
        # max_output_tokens cut it), as vLLM does: the openai client's stream helper
        # (``responses.stream(...).get_final_response()``) waits for this event.
        await sse.write(self._event("response.completed", response=self.response()))


def _choice(body: ResponsesRequest) -> str | dict[str, Any]:
    if body.tool_choice is not None:
        return body.tool_choice
    return "auto" if body.tools else "none"
