"""POST /v1/chat/completions."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import jinja2
from aiohttp import web

from asyncengine.core.limits import show
from asyncengine.core.sampling_params import SamplingParams
from asyncengine.engine.engine import AsyncEngine
from asyncengine.engine.outputs import CompletionOutput, RequestOutput
from asyncengine.engine.streams import RequestStream
from asyncengine.entrypoints.http.errors import bad_request
from asyncengine.entrypoints.http.images import chat_prompt, placeholder_for, processor_options
from asyncengine.entrypoints.http.logprobs import chat_logprobs
from asyncengine.entrypoints.http.params import structured_outputs_of, to_sampling_params
from asyncengine.entrypoints.http.protocol import ChatCompletionRequest, ChatMessage, message_dicts
from asyncengine.entrypoints.http.reasoning import (
    ReasoningPlan,
    chat_template_kwargs,
    plan_reasoning,
)
from asyncengine.entrypoints.http.responses import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatLogprobs,
    CompletionTokensDetails,
    Delta,
    DeltaFunction,
    DeltaToolCall,
    FunctionCallOut,
    PromptTokensDetails,
    ToolCallOut,
    Usage,
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
from asyncengine.entrypoints.http.sse import SSEStream, event, text_template
from asyncengine.entrypoints.http.state import ServerState, state_of
from asyncengine.entrypoints.http.tools import (
    ToolPlan,
    check_no_other_format,
    finish_reason,
    plan_tools,
    tool_call_id,
)
from asyncengine.text.reasoning_parsers import ReasoningParser
from asyncengine.text.tool_parsers import ToolParser


def render_chat(engine: AsyncEngine, messages: list[ChatMessage],
                add_generation_prompt: bool = True, *, tools: list[dict] | None = None,
                continue_final_message: bool = False,
                template_kwargs: dict[str, Any] | None = None) -> str:
    """The prompt text of a conversation: the tokenizer's chat template or --chat-template,
    given the tools (as transformers' ``tools=``) and ``chat_template_kwargs``."""
    if not messages:
        raise bad_request("messages must not be empty", "messages")
    for i, m in enumerate(messages):
        if m.tool_calls is not None and m.role != "assistant":
            raise bad_request("only assistant messages hold tool_calls",
                              f"messages[{i}].tool_calls")
    kwargs = dict(template_kwargs or {})
    for reserved in ("messages", "conversation", "chat_template", "tokenize"):
        kwargs.pop(reserved, None)
    # chat_template_kwargs may set the template's own switches too (as vLLM lets them).
    add_generation_prompt = bool(kwargs.pop("add_generation_prompt", add_generation_prompt))
    continue_final_message = bool(kwargs.pop("continue_final_message", continue_final_message))
    if continue_final_message and add_generation_prompt:
        raise bad_request("continue_final_message needs add_generation_prompt to be false",
                          "continue_final_message")
    if tools:
        kwargs["tools"] = tools
    if continue_final_message:
        kwargs["continue_final_message"] = True
    placeholder = placeholder_for(engine, messages)  # images: a 400 if the model takes none
    try:
        return engine.tokenizer.apply_chat_template(
            message_dicts(messages, placeholder), add_generation_prompt=add_generation_prompt,
            **kwargs)
    except (ValueError, TypeError, jinja2.TemplateError) as e:
        raise bad_request(f"Cannot apply the chat template: {e}", "messages") from None


def default_max_tokens(state: ServerState, prompt_len: int) -> int | None:
    """The generation config's ``max_new_tokens``, within the context (None: up to it)."""
    default = state.generation_defaults.get("max_tokens")
    room = state.engine.max_model_len - prompt_len
    return min(default, room) if default is not None and room > 0 else None


async def create_chat_completion(request: web.Request) -> web.StreamResponse:
    state = state_of(request)
    body = await read_body(request, ChatCompletionRequest)
    call_id = request_id(request, "chatcmpl")
    if not body.stream:
        return json_response(await chat_completion(state, body, call_id, body.priority or 0))
    call, streams, params = await start_chat(state, body, call_id, body.priority or 0)
    return await run_sse(request, streams, call.render, call.on_end,
                         render_text=call.text_renderer(params.n))


async def chat_completion(state: ServerState, body: ChatCompletionRequest, call_id: str,
                          priority: int) -> ChatCompletion:
    """A whole (not streamed) chat completion: the route's and a batch line's."""
    call, streams, _ = await start_chat(state, body, call_id, priority)
    return call.response((await collect(streams))[0])


async def start_chat(state: ServerState, body: ChatCompletionRequest, call_id: str,
                     priority: int) -> tuple[_Chat, list[RequestStream], SamplingParams]:
    """Check the call, render its prompt and start its engine requests."""
    engine = state.engine
    lora = check_model(engine, body.model)
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
    most = engine.sampling_limits.max_logprobs
    if body.top_logprobs is not None and not 0 <= body.top_logprobs <= most:
        raise bad_request(f"top_logprobs must be in [0, {most}] (--max-logprobs), got "
                          f"{show(body.top_logprobs)}", "top_logprobs")
    plan = plan_tools(body.tools, body.tool_choice, body.parallel_tool_calls, state.settings)
    structured = structured_outputs_of(body)
    check_no_other_format(plan, structured)
    text = render_chat(engine, body.messages, body.add_generation_prompt is not False,
                       tools=plan.template_tools,
                       continue_final_message=bool(body.continue_final_message),
                       template_kwargs=chat_template_kwargs(state, body.chat_template_kwargs))
    reasoning = plan_reasoning(state, text)
    # The template already holds the special tokens (BOS etc.): add none.
    prompt = engine.tokenizer.encode(text, add_special_tokens=False)
    max_tokens = body.max_completion_tokens
    if max_tokens is None:
        max_tokens = body.max_tokens
    if max_tokens is None:
        max_tokens = default_max_tokens(state, len(prompt))
    params = to_sampling_params(
        body, max_tokens=max_tokens,
        logprobs=(body.top_logprobs or 0) if body.logprobs else None, prompt_logprobs=None,
        vocab_size=engine.tokenizer.vocab_size, defaults=state.generation_defaults,
        structured=plan.structured_outputs or structured, limits=engine.sampling_limits)
    reasoning.apply(params, body.thinking_token_budget, "thinking_token_budget")
    call = _Chat(state, body, call_id, plan, reasoning)
    if lora is not None:  # responses name the adapter
        call.model = lora
    engine_prompt = await chat_prompt(engine, body.messages, prompt, text,
                                      processor_options(engine, body.mm_processor_kwargs))
    streams = await open_streams(engine, [engine_prompt], params, call.id, priority,
                                 deltas_only=bool(body.stream), lora_name=lora)
    return call, streams, params


class _Chat:
    """One chat call: builds the response, or the chunks of its stream."""

    def __init__(self, state: ServerState, body: ChatCompletionRequest, id: str,
                 plan: ToolPlan, reasoning: ReasoningPlan | None = None) -> None:
        self.state = state
        self.plan = plan
        self.reasoning = reasoning or ReasoningPlan()
        self.include_reasoning = body.include_reasoning is not False
        self.parsers: dict[int, ToolParser] = {}  # streaming: per choice
        self.thinkers: dict[int, ReasoningParser] = {}  # streaming: per choice
        self.output_ids: dict[int, list[int]] = {}  # streaming, reasoning: to count it
        self.call_ids: dict[tuple[int, int], str] = {}
        self.id = id
        self.created = int(time.time())
        self.model = state.engine.model_name
        self.want_logprobs = bool(body.logprobs)
        self.num_top = body.top_logprobs or 0
        opts = body.stream_options
        settings = state.settings
        self.include_usage = bool(opts and opts.include_usage) or settings.force_include_usage
        self.continuous_usage = bool(opts and opts.continuous_usage_stats)
        self.cache_details = settings.prompt_tokens_details
        self.started: set[int] = set()
        self.finished: set[int] = set()
        self.prompt_tokens = self.cached_tokens = 0
        self.completion_tokens: dict[int, int] = {}
        self.reasoning_tokens: dict[int, int] = {}

    def _usage(self) -> Usage:
        c = sum(self.completion_tokens.values())
        details = None
        if self.reasoning.configured:
            details = CompletionTokensDetails(sum(self.reasoning_tokens.values()))
        cached = PromptTokensDetails(self.cached_tokens) if self.cache_details else None
        return Usage(self.prompt_tokens, c, self.prompt_tokens + c, details, cached)

    def _logprobs(self, c: CompletionOutput, token_ids: list[int]) -> ChatLogprobs | None:
        if not self.want_logprobs or not token_ids or not c.logprobs:
            return None
        positions = c.logprobs[-len(token_ids):]
        return ChatLogprobs(chat_logprobs(self.state.token_texts, token_ids, positions,
                                          self.num_top))

    # -- non-streaming ----------------------------------------------------------------------
    def response(self, out: RequestOutput) -> ChatCompletion:
        self.prompt_tokens = len(out.prompt_token_ids)
        self.cached_tokens = out.num_cached_tokens or 0
        choices = []
        for c in out.outputs:
            if c.finish_reason == "abort":
                raise aborted(self.state.engine)
            self.completion_tokens[c.index] = c.num_output_tokens
            logprobs = self._logprobs(c, c.token_ids)
            if self.want_logprobs and logprobs is None:
                logprobs = ChatLogprobs([])
            answer, thought = c.text, None
            thinker = self.reasoning.make()
            if thinker is not None:
                split = thinker.parse(c.text)
                answer = split.content or ""
                thought = split.reasoning if self.include_reasoning else None
                self.reasoning_tokens[c.index] = self.reasoning.count(c.token_ids)
            parsed = self.plan.parse(answer)
            calls = [ToolCallOut(tool_call_id(), FunctionCallOut(t.name, t.arguments))
                     for t in parsed.calls]
            content = parsed.content if calls else answer
            if thinker is not None and not content:
                content = None
            message = AssistantMessage("assistant", content, thought, thought, calls or None)
            choices.append(ChatChoice(c.index, message, logprobs,
                                      finish_reason(c.finish_reason, bool(calls)),
                                      c.stop_reason))
        return ChatCompletion(self.id, self.created, self.model, choices, self._usage())

    # -- streaming ----------------------------------------------------------------------------
    def _chunk(self, choice: ChatChunkChoice) -> bytes:
        usage = self._usage() if self.continuous_usage else None
        return event(ChatCompletionChunk(self.id, self.created, self.model, [choice],
                                         usage=usage))

    def text_renderer(self, n: int) -> Callable[[str], bytes] | None:
        """The chunk of a step that brings only content (see ``run_sse``), when this call's
        chunks can be that simple: one choice, no logprobs, no tool parsing, no usage in every
        chunk."""
        if n != 1 or self.want_logprobs or self.continuous_usage or \
                self.plan.make_parser is not None or self.reasoning.active:
            return None
        return text_template(lambda text: ChatCompletionChunk(
            self.id, self.created, self.model, [ChatChunkChoice(0, Delta(content=text))]))

    def render(self, i: int, out: RequestOutput) -> bytes:
        """The events for one streamed output (deltas only)."""
        self.prompt_tokens = len(out.prompt_token_ids)
        self.cached_tokens = out.num_cached_tokens or 0
        data = b""
        for c in out.outputs:
            idx = c.index
            if idx in self.finished:
                continue
            if c.finish_reason == "abort":
                raise aborted(self.state.engine)
            if idx not in self.started:
                self.started.add(idx)
                data += self._chunk(ChatChunkChoice(idx, Delta(role="assistant", content="")))
            self.completion_tokens[idx] = c.num_output_tokens
            if self.reasoning.active:
                ids = self.output_ids.setdefault(idx, [])
                ids += c.delta_token_ids
                if c.finish_reason is not None:
                    self.reasoning_tokens[idx] = self.reasoning.count(ids)
            logprobs = self._logprobs(c, c.delta_token_ids)
            delta = self._delta(idx, c.delta_text, c.finish_reason is not None)
            if c.finish_reason is not None:
                self.finished.add(idx)
            elif not (delta.content or delta.tool_calls or delta.reasoning) and \
                    logprobs is None:
                continue
            reason = c.finish_reason
            if idx in self.parsers:
                reason = finish_reason(reason, self.parsers[idx].made_calls)
            data += self._chunk(ChatChunkChoice(idx, delta, logprobs, reason, c.stop_reason))
        return data

    def _delta(self, idx: int, text: str, last: bool) -> Delta:
        """Plain content, or what the choice's reasoning and tool parsers make of it: the
        reasoning parser first, the tool parser reads only the answer."""
        thought = None
        if self.reasoning.active:
            thinker = self.thinkers.get(idx)
            if thinker is None:
                thinker = self.thinkers[idx] = self.reasoning.make()
            split = thinker.feed(text)
            if last:
                split.extend(thinker.finish())
            text = split.content
            thought = (split.reasoning or None) if self.include_reasoning else None
        if self.plan.make_parser is None:
            return Delta(content=text or None, reasoning=thought, reasoning_content=thought)
        parser = self.parsers.get(idx)
        if parser is None:
            parser = self.parsers[idx] = self.plan.make_parser()
        parsed = parser.feed(text)
        if last:
            parsed.extend(parser.finish())
        calls = []
        for piece in parsed.calls:
            first = piece.name is not None
            call_id = self.call_ids.setdefault((idx, piece.index), tool_call_id())
            calls.append(DeltaToolCall(
                piece.index, DeltaFunction(piece.name, piece.arguments),
                id=call_id if first else None, type="function" if first else None))
        return Delta(content=parsed.content or None, reasoning=thought,
                     reasoning_content=thought, tool_calls=calls or None)

    async def on_end(self, sse: SSEStream) -> None:
        if self.include_usage:
            await sse.send(ChatCompletionChunk(self.id, self.created, self.model, [],
                                               usage=self._usage()))
