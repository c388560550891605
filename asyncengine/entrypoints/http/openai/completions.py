"""POST /v1/completions."""

from __future__ import annotations

import time
from collections.abc import Callable

from aiohttp import web

from asyncengine.engine.outputs import RequestOutput
from asyncengine.engine.streams import RequestStream
from asyncengine.entrypoints.http.errors import bad_request
from asyncengine.entrypoints.http.logprobs import CompletionLogprobsBuilder
from asyncengine.entrypoints.http.params import to_sampling_params
from asyncengine.entrypoints.http.protocol import CompletionRequest
from asyncengine.entrypoints.http.responses import (
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    PromptTokensDetails,
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
from asyncengine.text.fim import FimTokens, fim_prompt, tokenizer_fim_tokens


def completion_prompts(prompt: str | list) -> list[str | list[int]]:
    """OpenAI's four prompt forms, as a list of engine prompts."""
    if isinstance(prompt, str):
        return [prompt]
    if prompt and all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    if prompt and all(isinstance(p, str) for p in prompt):
        return list(prompt)
    if prompt and all(isinstance(p, list) for p in prompt):
        return [list(p) for p in prompt]
    raise bad_request("prompt must be a string, a list of strings, a list of token ids or a "
                      "list of token-id lists (not empty, not mixed)", "prompt")


def insertion_prompts(tokenizer, fim: FimTokens, prompts: list[str | list[int]],
                      suffix: str) -> list[str | list[int]]:
    """OpenAI's ``suffix``: each prompt as the text before an insertion, ``suffix`` after
    it, in the model's fill-in-the-middle form (``text/fim.py``)."""
    bos = tokenizer.encode("", add_special_tokens=True)

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    return [fim_prompt(fim, encode, p, suffix, bos=bos) for p in prompts]


def completion_allows(state: ServerState) -> frozenset[str]:
    """The refused options this server honours: ``suffix`` on a code model (insertion)."""
    fim = tokenizer_fim_tokens(state.engine.tokenizer)
    return frozenset({"suffix"}) if fim is not None else frozenset()


async def create_completion(request: web.Request) -> web.StreamResponse:
    state = state_of(request)
    body = await read_body(request, CompletionRequest, completion_allows(state))
    call_id = request_id(request, "cmpl")
    if not body.stream:
        return json_response(await completion(state, body, call_id, body.priority or 0))
    call, streams = await start_completion(state, body, call_id, body.priority or 0)
    return await run_sse(request, streams, call.render, call.on_end,
                         render_text=call.text_renderer())


async def completion(state: ServerState, body: CompletionRequest, call_id: str,
                     priority: int) -> Completion:
    """A whole (not streamed) completion: the route's and a batch line's."""
    call, streams = await start_completion(state, body, call_id, priority)
    return call.response(await collect(streams))


async def start_completion(state: ServerState, body: CompletionRequest, call_id: str,
                           priority: int) -> tuple[_Completion, list[RequestStream]]:
    """Check the call and start its engine requests (one per prompt)."""
    engine = state.engine
    fim = tokenizer_fim_tokens(engine.tokenizer)  # a code model: suffix is insertion
    lora = check_model(engine, body.model)
    prompts = completion_prompts(body.prompt)
    echo = bool(body.echo)
    if body.suffix and fim is not None:
        if echo:
            raise bad_request("echo cannot be combined with suffix (insertion)", "suffix")
        prompts = insertion_prompts(engine.tokenizer, fim, prompts, body.suffix)
    params = to_sampling_params(
        body, max_tokens=16 if body.max_tokens is None else body.max_tokens,
        logprobs=body.logprobs,
        prompt_logprobs=body.logprobs if echo and body.logprobs is not None else None,
        vocab_size=engine.tokenizer.vocab_size, defaults=state.generation_defaults,
        limits=engine.sampling_limits)
    call = _Completion(state, body, call_id, params.n)
    if lora is not None:  # responses name the adapter
        call.model = lora
    streams = await open_streams(engine, prompts, params, call.id, priority,
                                 deltas_only=bool(body.stream), lora_name=lora)
    return call, streams


class _Completion:
    """One completions call: builds the response, or the chunks of its stream."""

    def __init__(self, state: ServerState, body: CompletionRequest, id: str, n: int) -> None:
        self.state = state
        self.id = id
        self.n = n
        self.created = int(time.time())
        self.model = state.engine.model_name
        self.echo = bool(body.echo)
        self.want_logprobs = body.logprobs is not None
        opts = body.stream_options
        self.include_usage = bool(opts and opts.include_usage) or \
            state.settings.force_include_usage
        self.cache_details = state.settings.prompt_tokens_details
        self.cached_tokens: dict[int, int] = {}
        self.continuous_usage = bool(opts and opts.continuous_usage_stats)
        # Streaming state, per choice index.
        self.builders: dict[int, CompletionLogprobsBuilder] = {}
        self.started: set[int] = set()
        self.finished: set[int] = set()
        self.prompt_tokens: dict[int, int] = {}
        self.completion_tokens: dict[int, int] = {}

    def _prompt_text(self, out: RequestOutput) -> str:
        if out.prompt is not None:
            return out.prompt
        return self.state.engine.tokenizer.decode(out.prompt_token_ids, skip_special_tokens=False)

    def _usage(self) -> Usage:
        p = sum(self.prompt_tokens.values())
        c = sum(self.completion_tokens.values())
        cached = PromptTokensDetails(sum(self.cached_tokens.values())) if self.cache_details \
            else None
        return Usage(p, c, p + c, prompt_tokens_details=cached)

    # -- non-streaming ----------------------------------------------------------------------
    def response(self, finals: list[RequestOutput]) -> Completion:
        choices = []
        for i, out in enumerate(finals):
            self.prompt_tokens[i] = len(out.prompt_token_ids)
            self.cached_tokens[i] = out.num_cached_tokens or 0
            prefix = self._prompt_text(out) if self.echo else ""
            for c in out.outputs:
                if c.finish_reason == "abort":
                    raise aborted(self.state.engine)
                idx = i * self.n + c.index
                self.completion_tokens[idx] = c.num_output_tokens
                logprobs = None
                if self.want_logprobs:
                    builder = CompletionLogprobsBuilder(self.state.token_texts)
                    logprobs = CompletionLogprobs([], [], [], [])
                    if self.echo:
                        builder.build(out.prompt_token_ids, out.prompt_logprobs, logprobs)
                    builder.build(c.token_ids, c.logprobs, logprobs)
                choices.append(CompletionChoice(idx, prefix + c.text, logprobs,
                                                c.finish_reason, c.stop_reason))
        return Completion(self.id, self.created, self.model, choices, usage=self._usage())

    # -- streaming ----------------------------------------------------------------------------
    def render(self, i: int, out: RequestOutput) -> bytes:
        """The events for one streamed output (deltas only)."""
        self.prompt_tokens[i] = len(out.prompt_token_ids)
        self.cached_tokens[i] = out.num_cached_tokens or 0
        data = b""
        for c in out.outputs:
            idx = i * self.n + c.index
            if idx in self.finished:
                continue
            if c.finish_reason == "abort":
                raise aborted(self.state.engine)
            text = c.delta_text
            logprobs = None
            if idx not in self.started:
                self.started.add(idx)
                if self.echo:
                    text = self._prompt_text(out) + text
                if self.want_logprobs:
                    self.builders[idx] = CompletionLogprobsBuilder(self.state.token_texts)
                    if self.echo:
                        logprobs = self.builders[idx].build(out.prompt_token_ids,
                                                            out.prompt_logprobs)
            new = c.delta_token_ids
            if self.want_logprobs and new:
                positions = c.logprobs[-len(new):] if c.logprobs else None
                logprobs = self.builders[idx].build(new, positions, logprobs)
            self.completion_tokens[idx] = c.num_output_tokens
            if c.finish_reason is not None:
                self.finished.add(idx)
            elif not text and logprobs is None:
                continue
            choice = CompletionChoice(idx, text, logprobs, c.finish_reason, c.stop_reason)
            usage = self._usage() if self.continuous_usage else None
            data += event(Completion(self.id, self.created, self.model, [choice], usage=usage))
        return data

    def text_renderer(self) -> Callable[[str], bytes] | None:
        """The chunk of a step that brings only text (see ``run_sse``), when this call's chunks
        can be that simple: one choice, no logprobs, no usage in every chunk."""
        if self.n != 1 or self.want_logprobs or self.continuous_usage:
            return None
        return text_template(lambda text: Completion(
            self.id, self.created, self.model, [CompletionChoice(0, text, None, None, None)]))

    async def on_end(self, sse: SSEStream) -> None:
        if self.include_usage:
            await sse.send(Completion(self.id, self.created, self.model, [],
                                      usage=self._usage()))
