"""llama-server's own routes, for its clients: ``POST /completion`` and ``GET /props``
(``POST /infill``, for code models, is ``llama_infill.py``).

``/completion`` (also ``/completions``) takes llama.cpp's body: ``prompt`` (a string or token
ids), ``n_predict`` (-1: up to the context), ``temperature``, ``top_k``, ``top_p``, ``min_p``,
``repeat_penalty``, ``presence_penalty``, ``frequency_penalty``, ``stop``, ``seed`` (-1:
random), ``ignore_eos``, ``json_schema`` or ``grammar``, ``stream``, ``return_tokens``. What a
body leaves unset takes the server's sampling defaults, as the OpenAI routes do (the model's
generation config, ``--override-generation-config``, llama-server's ``--temp``...). It answers
as llama-server does: ``content``, ``stop``, ``stop_type`` (``eos``, ``word``, ``limit``),
``stopping_word``, ``tokens_predicted``, ``tokens_evaluated``, ``tokens_cached``,
``timings``; streamed, one ``data: {"content": ..., "stop": false}`` event a step and a last
one with ``"stop": true`` and the figures (no ``[DONE]``). Slot and cache hints (``id_slot``,
``cache_prompt``, ``n_keep``, ``samplers``) are accepted and have no effect here; samplers
asyncengine lacks (mirostat, typical-p, DRY, XTC, token probabilities) are a 400 naming the
field rather than ignored.

``/props`` gives what llama.cpp's clients read from it: the context size (``n_ctx``), the
slots (``total_slots``: ``--max-num-seqs``), the model's path and alias, the chat template.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from aiohttp import web
from msgspec import Meta, Struct

from asyncengine.core.limits import INT64_MAX
from asyncengine.core.multimodal import ImagePrompt
from asyncengine.core.sampling_params import SamplingParams, StructuredOutputsParams
from asyncengine.engine.multimodal import image_encoder, image_placeholder
from asyncengine.engine.outputs import CompletionOutput, RequestOutput
from asyncengine.entrypoints.http.errors import bad_request
from asyncengine.entrypoints.http.images import with_images
from asyncengine.entrypoints.http.params import to_sampling_params
from asyncengine.entrypoints.http.protocol import Body, GenerationBody, Int64, TokenId
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

NonEmptyText = Annotated[str, Meta(min_length=1)]
TokenIds = Annotated[list[TokenId], Meta(min_length=1)]


class LlamaSampling(Body, kw_only=True):
    """The generation fields of llama-server's /completion and /infill bodies. Unset
    sampling fields take the server's defaults; ``n_predict`` -1 (or unset) generates up to
    the context, 0 nothing."""

    model: str | None = None
    n_predict: Annotated[int, Meta(ge=-1, le=INT64_MAX)] | None = None
    temperature: float | None = None
    top_k: Annotated[int, Meta(ge=-1)] | None = None  # past the vocabulary: all tokens
    top_p: float | None = None
    min_p: float | None = None
    repeat_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stop: list[str] | None = None
    seed: Int64 | None = None  # negative: random
    ignore_eos: bool | None = None
    stream: bool = False
    return_tokens: bool = False
    json_schema: dict[str, Any] | None = None
    grammar: str | None = None
    # llama-server's slot and cache hints: accepted, no effect here
    id_slot: Int64 | None = None
    cache_prompt: bool | None = None
    n_keep: Int64 | None = None
    samplers: list[str] | None = None
    # samplers asyncengine lacks: accepted at their neutral value only
    mirostat: Annotated[int, Meta(ge=0, le=0)] = 0
    typical_p: Annotated[float, Meta(ge=1.0, le=1.0)] = 1.0
    dry_multiplier: Annotated[float, Meta(ge=0.0, le=0.0)] = 0.0
    xtc_probability: Annotated[float, Meta(ge=0.0, le=0.0)] = 0.0
    n_probs: Annotated[int, Meta(ge=0, le=0)] = 0
    logit_bias: Annotated[list[Any], Meta(max_length=0)] | None = None


class MultimodalPrompt(Body, kw_only=True):
    """llama-server's prompt with media: ``prompt_string`` holds one ``<__media__>`` marker
    per item of ``multimodal_data`` (base64 images), in order."""

    prompt_string: NonEmptyText
    multimodal_data: list[str] | None = None


#: llama.cpp's media marker (mtmd's default).
MEDIA_MARKER = "<__media__>"


class LlamaCompletionRequest(LlamaSampling, kw_only=True):
    """POST /completion: a prompt as text or token ids, or text with images."""

    prompt: NonEmptyText | TokenIds | MultimodalPrompt


async def _with_media(state: ServerState, prompt: MultimodalPrompt) -> tuple[str, Any]:
    """(the prompt text, what the engine takes: the text with the model's image placeholders
    and the decoded images)."""
    data = prompt.multimodal_data or []
    text = prompt.prompt_string
    if text.count(MEDIA_MARKER) != len(data):
        raise bad_request(f"prompt_string holds {text.count(MEDIA_MARKER)} {MEDIA_MARKER} "
                          f"markers for {len(data)} multimodal_data items", "prompt")
    if not data:
        return text, text
    urls = [f"data:;base64,{d}" for d in data]  # the decoder sniffs the format
    engine = state.engine
    loaded = await with_images(engine, urls, "", "multimodal_data")
    text = text.replace(MEDIA_MARKER, image_placeholder(engine) or "")
    return text, ImagePrompt(text, loaded.images)


class LlamaTimings(Struct, kw_only=True):
    cache_n: int
    prompt_n: int
    prompt_ms: float
    prompt_per_token_ms: float
    prompt_per_second: float
    predicted_n: int
    predicted_ms: float
    predicted_per_token_ms: float
    predicted_per_second: float


class LlamaCompletion(Struct, kw_only=True, omit_defaults=True):
    """A /completion answer, and its stream's events: ``stop`` false for a step's text, true
    for the last event, which holds the figures (and no ``prompt``)."""

    content: str
    stop: bool
    index: int = 0
    id_slot: int = -1
    tokens: list[int] | None = None
    model: str | None = None
    prompt: str | None = None
    tokens_predicted: int | None = None
    tokens_evaluated: int | None = None
    tokens_cached: int | None = None
    truncated: bool | None = None
    stop_type: Literal["eos", "word", "limit"] | None = None
    stopping_word: str | None = None
    has_new_line: bool | None = None
    generation_settings: dict[str, Any] | None = None
    timings: LlamaTimings | None = None


class LlamaProps(Struct, kw_only=True):
    default_generation_settings: dict[str, Any]
    total_slots: int
    model_path: str
    model_alias: str
    chat_template: str
    modalities: dict[str, bool]
    build_info: str
    is_sleeping: bool


def _sampling(body: LlamaSampling, state: ServerState) -> SamplingParams:
    if body.json_schema is not None and body.grammar is not None:
        raise bad_request("give json_schema or grammar (one structured_outputs constraint), "
                          "not both", "grammar")
    structured = None
    try:
        if body.json_schema is not None:
            structured = StructuredOutputsParams(json=body.json_schema)
        elif body.grammar:
            structured = StructuredOutputsParams(grammar=body.grammar)
    except ValueError as e:
        raise bad_request(str(e), "json_schema" if body.json_schema is not None
                          else "grammar") from None
    defaults = state.generation_defaults or {}
    n = body.n_predict
    max_tokens = defaults.get("max_tokens") if n is None else (None if n < 0 else n)
    if max_tokens == 0:  # nothing is generated (the handler answers); the rest is checked
        max_tokens = 1
    generic = GenerationBody(
        temperature=body.temperature, top_k=body.top_k, top_p=body.top_p, min_p=body.min_p,
        repetition_penalty=body.repeat_penalty, presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty, stop=body.stop,
        seed=None if body.seed is None or body.seed < 0 else body.seed,
        ignore_eos=body.ignore_eos)
    engine = state.engine
    return to_sampling_params(generic, max_tokens=max_tokens, logprobs=None,
                              prompt_logprobs=None, vocab_size=engine.tokenizer.vocab_size,
                              defaults=defaults, structured=structured,
                              limits=engine.sampling_limits)


async def llama_completion(request: web.Request) -> web.StreamResponse:
    """POST /completion, /completions: llama-server's completion route."""
    body = await read_body(request, LlamaCompletionRequest)
    if isinstance(body.prompt, MultimodalPrompt):
        return await complete(request, body, *await _with_media(state_of(request), body.prompt))
    return await complete(request, body, body.prompt)


async def complete(request: web.Request, body: LlamaSampling,
                   prompt: str | list[int], engine_prompt: Any = None) -> web.StreamResponse:
    """Run ``prompt`` with ``body``'s sampling; answer as llama-server (streamed or not).
    ``engine_prompt``: what the engine runs instead (the prompt with its images)."""
    state = state_of(request)
    lora = check_model(state.engine, body.model)
    params = _sampling(body, state)
    call = _Call(state, body, prompt, lora)
    if body.n_predict == 0:  # llama-server: the prompt read, nothing generated
        return json_response(call.nothing())
    streams = await open_streams(state.engine, [engine_prompt or prompt], params,
                                 request_id(request, "cmpl"), 0, deltas_only=body.stream,
                                 lora_name=lora)
    if body.stream:
        text = None if body.return_tokens else text_template(
            lambda t: LlamaCompletion(content=t, stop=False))
        return await run_sse(request, streams, call.render, call.on_end, done_marker=False,
                             render_text=text)
    (out,) = await collect(streams)
    return json_response(call.final(out, out.outputs[0]))


class _Call:
    """One /completion call: its stream's events, and its final object."""

    def __init__(self, state: ServerState, body: LlamaSampling, prompt: str | list[int],
                 lora: str | None) -> None:
        self.state = state
        self.body = body
        self.prompt = prompt
        self.model = lora or state.served_model_names[0]

    def render(self, _i: int, out: RequestOutput) -> bytes:
        c = out.outputs[0]
        data = b""
        if c.delta_text or (c.delta_token_ids and self.body.return_tokens):
            tokens = list(c.delta_token_ids) if self.body.return_tokens else None
            data = event(LlamaCompletion(content=c.delta_text, stop=False, tokens=tokens))
        if out.finished:
            data += event(self.final(out, c, streamed=True))
        return data

    async def on_end(self, sse: SSEStream) -> None:
        pass

    def final(self, out: RequestOutput, c: CompletionOutput,
              streamed: bool = False) -> LlamaCompletion:
        if c.finish_reason == "abort":
            raise aborted(self.state.engine)
        word = c.finish_reason == "stop" and isinstance(c.stop_reason, str)
        prompt = None
        if not streamed:
            prompt = out.prompt if out.prompt is not None else \
                self.state.engine.tokenizer.decode(out.prompt_token_ids)
        return LlamaCompletion(
            content="" if streamed else c.text, stop=True, model=self.model, prompt=prompt,
            tokens=list(c.token_ids) if self.body.return_tokens and not streamed else None,
            tokens_predicted=c.num_output_tokens, tokens_evaluated=len(out.prompt_token_ids),
            tokens_cached=out.num_cached_tokens or 0, truncated=False,
            stop_type="limit" if c.finish_reason == "length" else "word" if word else "eos",
            stopping_word=c.stop_reason if word else "",
            has_new_line=False if streamed else "\n" in c.text,
            generation_settings=self._settings(), timings=_timings(out, c.num_output_tokens))

    def nothing(self) -> LlamaCompletion:
        """``n_predict`` 0: the prompt's tokens counted, no output."""
        prompt = self.prompt
        tokenizer = self.state.engine.tokenizer
        ids = prompt if isinstance(prompt, list) else tokenizer.encode(prompt)
        text = prompt if isinstance(prompt, str) else tokenizer.decode(prompt)
        zero = LlamaTimings(cache_n=0, prompt_n=0, prompt_ms=0.0, prompt_per_token_ms=0.0,
                            prompt_per_second=0.0, predicted_n=0, predicted_ms=0.0,
                            predicted_per_token_ms=0.0, predicted_per_second=0.0)
        return LlamaCompletion(content="", stop=True, model=self.model, prompt=text,
                               tokens=[] if self.body.return_tokens else None,
                               tokens_predicted=0, tokens_evaluated=len(ids), tokens_cached=0,
                               truncated=False, stop_type="limit", stopping_word="",
                               has_new_line=False, generation_settings=self._settings(),
                               timings=zero)

    def _settings(self) -> dict[str, Any]:
        b = self.body
        return {"n_predict": -1 if b.n_predict is None else b.n_predict,
                "temperature": b.temperature, "top_k": b.top_k, "top_p": b.top_p,
                "min_p": b.min_p, "repeat_penalty": b.repeat_penalty,
                "seed": -1 if b.seed is None else b.seed, "stop": b.stop or [],
                "ignore_eos": bool(b.ignore_eos), "model": self.model}


def _timings(out: RequestOutput, predicted_n: int) -> LlamaTimings:
    """llama-server's ``timings`` from the request's times (ms; per-second rates)."""
    m = out.metrics
    cached = out.num_cached_tokens or 0
    prompt_n = len(out.prompt_token_ids) - cached
    prompt_ms = predicted_ms = 0.0
    if m is not None and m.first_token_time is not None:
        start = m.first_scheduled_time or m.arrival_time
        prompt_ms = max(0.0, (m.first_token_time - start) * 1e3)
        if m.last_token_time is not None:
            predicted_ms = max(0.0, (m.last_token_time - m.first_token_time) * 1e3)
    return LlamaTimings(
        cache_n=cached, prompt_n=prompt_n, prompt_ms=prompt_ms,
        prompt_per_token_ms=prompt_ms / prompt_n if prompt_n else 0.0,
        prompt_per_second=1e3 * prompt_n / prompt_ms if prompt_ms else 0.0,
        predicted_n=predicted_n, predicted_ms=predicted_ms,
        predicted_per_token_ms=predicted_ms / predicted_n if predicted_n else 0.0,
        predicted_per_second=(1e3 * (predicted_n - 1) / predicted_ms
                              if predicted_ms and predicted_n > 1 else 0.0))


async def props(request: web.Request) -> web.Response:
    """GET /props: llama-server's server properties, those its clients read."""
    state = state_of(request)
    engine = state.engine
    template = getattr(engine.tokenizer, "chat_template", None)
    return json_response(LlamaProps(
        default_generation_settings={"n_ctx": engine.max_model_len,
                                     "params": dict(state.generation_defaults or {})},
        total_slots=engine.config.scheduler.max_num_seqs,
        model_path=str(engine.config.model.model or engine.model_name),
        model_alias=state.served_model_names[0],
        chat_template=template if isinstance(template, str) else "",
        modalities={"vision": image_encoder(engine) is not None, "audio": False},
        build_info="asyncengine",
        is_sleeping=False))
