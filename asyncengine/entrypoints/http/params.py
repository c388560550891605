"""From a request body to ``SamplingParams``: OpenAI's and vLLM's defaults, validation as 400s."""

from __future__ import annotations

import re
from dataclasses import fields
from typing import Any

from asyncengine.core.limits import SamplingLimits, show
from asyncengine.core.sampling_params import SamplingParams, StructuredOutputsParams
from asyncengine.entrypoints.http.errors import bad_request, from_value_error
from asyncengine.entrypoints.http.protocol import (
    GenerationBody,
    ResponseFormatJsonObject,
    ResponseFormatJsonSchema,
)

_DECIMAL = re.compile(r"0|[1-9][0-9]*")

KNOWN_PARAMS = frozenset(f.name for f in fields(SamplingParams)) | {
    "max_completion_tokens", "top_logprobs", "prompt", "messages", "response_format"}


def _or(value: Any, default: Any) -> Any:
    return default if value is None else value


def to_sampling_params(body: GenerationBody, *, max_tokens: int | None, logprobs: int | None,
                       prompt_logprobs: int | None, vocab_size: int,
                       defaults: dict[str, Any] | None = None,
                       structured: StructuredOutputsParams | None = None,
                       limits: SamplingLimits | None = None) -> SamplingParams:
    """Raise ``APIError`` (400) for an invalid value, naming the parameter.

    ``defaults`` are the server's sampling defaults (--generation-config) for what the body
    leaves unset; ``structured`` a constraint the server adds (tool calls), exclusive with
    the body's own; ``limits`` the engine's (``--max-n``, ``--max-logprobs``, the model's
    vocabulary)."""
    stop = body.stop
    d = defaults or {}
    if structured is None:
        structured = structured_outputs_of(body)
    top_k = _or(body.top_k, d.get("top_k", 0))
    vocab = limits.vocab_size if limits is not None and limits.vocab_size else vocab_size
    if isinstance(top_k, int) and top_k > vocab:
        top_k = vocab  # past the vocabulary means all tokens
    try:
        params = SamplingParams(
            n=_or(body.n, 1),
            temperature=_or(body.temperature, d.get("temperature", 1.0)),
            top_p=_or(body.top_p, d.get("top_p", 1.0)),
            top_k=top_k,
            min_p=_or(body.min_p, d.get("min_p", 0.0)),
            presence_penalty=_or(body.presence_penalty, 0.0),
            frequency_penalty=_or(body.frequency_penalty, 0.0),
            repetition_penalty=_or(body.repetition_penalty, d.get("repetition_penalty", 1.0)),
            seed=body.seed,
            max_tokens=max_tokens,
            min_tokens=_or(body.min_tokens, 0),
            stop=[stop] if isinstance(stop, str) else list(stop or []),
            stop_token_ids=list(body.stop_token_ids or []),
            ignore_eos=bool(body.ignore_eos),
            include_stop_str_in_output=bool(body.include_stop_str_in_output),
            skip_special_tokens=_or(body.skip_special_tokens, True),
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            logit_bias=_logit_bias(body.logit_bias, vocab_size),
            structured_outputs=structured,
        )
        params.validate(limits)
    except ValueError as e:
        raise from_value_error(e, KNOWN_PARAMS) from None
    return params


def _logit_bias(bias: dict[str, float] | None, vocab_size: int) -> dict[int, float] | None:
    if not bias:
        return None
    out: dict[int, float] = {}
    for key, value in bias.items():
        if not _DECIMAL.fullmatch(key):  # as /openapi.json publishes: no sign, no padding
            raise bad_request(f"logit_bias keys must be token ids (decimal digits), got "
                              f"{show(key)}", "logit_bias")
        token_id = int(key)
        if not 0 <= token_id < vocab_size:
            raise bad_request(f"logit_bias: token id {token_id} is out of vocabulary "
                              f"(0..{vocab_size - 1})", "logit_bias")
        if not -100 <= value <= 100:
            raise bad_request(f"logit_bias values must be in [-100, 100], got {value}",
                              "logit_bias")
        out[token_id] = value
    return out


def structured_outputs_of(body: GenerationBody) -> StructuredOutputsParams | None:
    """From ``response_format``, ``structured_outputs`` or vLLM's older ``guided_*``."""
    fmt = body.response_format
    spec = None
    if isinstance(fmt, ResponseFormatJsonObject):
        spec = StructuredOutputsParams(json_object=True)
    elif isinstance(fmt, ResponseFormatJsonSchema):
        try:
            spec = StructuredOutputsParams(json=fmt.json_schema.schema_)
        except ValueError as e:
            raise bad_request(f"response_format: {e}", "response_format") from None
    so = body.structured_outputs
    guided = {k: v for k, v in (("json", body.guided_json), ("regex", body.guided_regex),
                                ("choice", body.guided_choice), ("grammar", body.guided_grammar))
              if v is not None}
    if guided:
        if so is not None or spec is not None or len(guided) > 1:
            raise bad_request("give one of response_format, structured_outputs and guided_*",
                              "guided_" + next(iter(guided)))
        try:
            return StructuredOutputsParams(**guided)
        except ValueError as e:
            raise bad_request(str(e), "guided_" + next(iter(guided))) from None
    if so is None:
        return spec
    if spec is not None:
        raise bad_request("give either response_format or structured_outputs, not both",
                          "structured_outputs")
    try:
        return StructuredOutputsParams(json=so.json, json_object=bool(so.json_object),
                                       regex=so.regex, choice=so.choice, grammar=so.grammar)
    except ValueError as e:
        raise bad_request(str(e), "structured_outputs") from None
