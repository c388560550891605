"""POST /v1/chat/completions."""

from __future__ import annotations

import time

import jinja2
from aiohttp import web

from asyncengine.engine.engine import AsyncEngine
from asyncengine.engine.outputs import CompletionOutput, RequestOutput
from asyncengine.entrypoints.http.errors import APIError, bad_request
from asyncengine.entrypoints.http.logprobs import chat_logprobs
from asyncengine.entrypoints.http.params import to_sampling_params
from asyncengine.entrypoints.http.protocol import ChatCompletionRequest, ChatMessage, message_dicts
from asyncengine.entrypoints.http.responses import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatLogprobs,
    Delta,
    Usage,
)
from asyncengine.entrypoints.http.serving import (
    SHUTDOWN_ABORT,
    check_model,
    collect,
    json_response,
    open_streams,
    random_id,
    read_body,
    run_sse,
)
from asyncengine.entrypoints.http.sse import SSEStream, event
from asyncengine.entrypoints.http.state import ServerState, state_of


def render_chat(engine: AsyncEngine, messages: list[ChatMessage],
                add_generation_prompt: bool = True) -> str:
    """The prompt text of a conversation: the tokenizer's chat template or --chat-template."""
    if not messages:
        raise bad_request("messages must not be empty", "messages")
    try:
        return engine.tokenizer.apply_chat_template(
            message_dicts(messages), add_generation_prompt=add_generation_prompt)
    except (ValueError, jinja2.TemplateError) as e:
        raise bad_request(f"Cannot apply the chat template: {e}", "messages") from None


async def create_chat_completion(request: web.Request) -> web.StreamResponse:
    state = state_of(request)
    engine = state.engine
    body = await read_body(request, ChatCompletionRequest)
    check_model(engine, body.model)
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
    text = render_chat(engine, body.messages, body.add_generation_prompt is not False)
    # The template already holds the special tokens (BOS etc.): add none.
    prompt = engine.tokenizer.encode(text, add_special_tokens=False)
    max_tokens = body.max_completion_tokens
    if max_tokens is None:
        max_tokens = body.max_tokens
    params = to_sampling_params(
        body, max_tokens=max_tokens,
        logprobs=(body.top_logprobs or 0) if body.logprobs else None, prompt_logprobs=None,
        vocab_size=engine.tokenizer.vocab_size)
    call = _Chat(state, body, random_id("chatcmpl"))
    streams = await open_streams(engine, [prompt], params, call.id, body.priority or 0)
    if body.stream:
        return await run_sse(request, streams, call.on_output, call.on_end)
    return json_response(call.response((await collect(streams))[0]))


class _Chat:
    """One chat call: builds the response, or the chunks of its stream."""

    def __init__(self, state: ServerState, body: ChatCompletionRequest, id: str) -> None:
        self.state = state
        self.id = id
        self.created = int(time.time())
        self.model = state.engine.model_name
        self.want_logprobs = bool(body.logprobs)
        self.num_top = body.top_logprobs or 0
        opts = body.stream_options
        self.include_usage = bool(opts and opts.include_usage)
        self.continuous_usage = bool(opts and opts.continuous_usage_stats)
        self.started: set[int] = set()
        self.finished: set[int] = set()
        self.prompt_tokens = 0
        self.completion_tokens: dict[int, int] = {}

    def _usage(self) -> Usage:
        c = sum(self.completion_tokens.values())
        return Usage(self.prompt_tokens, c, self.prompt_tokens + c)

    def _logprobs(self, c: CompletionOutput, token_ids: list[int]) -> ChatLogprobs | None:
        if not self.want_logprobs or not token_ids or not c.logprobs:
            return None
        positions = c.logprobs[-len(token_ids):]
        return ChatLogprobs(chat_logprobs(self.state.token_texts, token_ids, positions,
                                          self.num_top))

    # -- non-streaming ----------------------------------------------------------------------
    def response(self, out: RequestOutput) -> ChatCompletion:
        self.prompt_tokens = len(out.prompt_token_ids)
        choices = []
        for c in out.outputs:
            if c.finish_reason == "abort":
                raise APIError(503, SHUTDOWN_ABORT)
            self.completion_tokens[c.index] = len(c.token_ids)
            logprobs = self._logprobs(c, c.token_ids)
            if self.want_logprobs and logprobs is None:
                logprobs = ChatLogprobs([])
            choices.append(ChatChoice(c.index, AssistantMessage("assistant", c.text), logprobs,
                                      c.finish_reason, c.stop_reason))
        return ChatCompletion(self.id, self.created, self.model, choices, self._usage())

    # -- streaming ----------------------------------------------------------------------------
    def _chunk(self, choice: ChatChunkChoice) -> bytes:
        usage = self._usage() if self.continuous_usage else None
        return event(ChatCompletionChunk(self.id, self.created, self.model, [choice],
                                         usage=usage))

    async def on_output(self, sse: SSEStream, i: int, out: RequestOutput) -> None:
        self.prompt_tokens = len(out.prompt_token_ids)
        data = b""
        for c in out.outputs:
            idx = c.index
            if idx in self.finished:
                continue
            if c.finish_reason == "abort":
                raise APIError(503, SHUTDOWN_ABORT)
            if idx not in self.started:
                self.started.add(idx)
                data += self._chunk(ChatChunkChoice(idx, Delta(role="assistant", content="")))
            self.completion_tokens[idx] = len(c.token_ids)
            logprobs = self._logprobs(c, c.delta_token_ids)
            if c.finish_reason is not None:
                self.finished.add(idx)
            elif not c.delta_text and logprobs is None:
                continue
            delta = Delta(content=c.delta_text or None)
            data += self._chunk(ChatChunkChoice(idx, delta, logprobs, c.finish_reason,
                                                c.stop_reason))
        if data:
            await sse.write(data)

    async def on_end(self, sse: SSEStream) -> None:
        if self.include_usage:
            await sse.send(ChatCompletionChunk(self.id, self.created, self.model, [],
                                               usage=self._usage()))
