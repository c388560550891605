"""The validated ranges of the generation parameters, as JSON Schema bounds in /openapi.json.

They come from the same table ``SamplingParams.validate`` checks (``asyncengine.core.limits``)
and from the server's own limits (``--max-n``, ``--max-logprobs``), so the document states
exactly what the server refuses with a 400.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from asyncengine.core.limits import (
    FLOAT_RANGES,
    INT64_MAX,
    INT64_MIN,
    LOGIT_BIAS_RANGE,
    SamplingLimits,
)


def parameter_bounds(limits: SamplingLimits) -> dict[str, dict[str, Any]]:
    """JSON Schema keywords for each bounded parameter of a generation request body."""
    bounds: dict[str, dict[str, Any]] = {n: r.json_schema() for n, r in FLOAT_RANGES.items()}
    int64 = {"minimum": INT64_MIN, "maximum": INT64_MAX}
    bounds.update({
        "n": {"minimum": 1, "maximum": limits.max_n},
        "seed": dict(int64),
        "top_k": {"minimum": -1, "description": "-1 or 0: disabled; values past the "
                  "vocabulary size mean all tokens"},
        "max_tokens": {"minimum": 1, "maximum": INT64_MAX},
        "repeat_penalty": FLOAT_RANGES["repetition_penalty"].json_schema(),  # llama-server's
        "max_completion_tokens": {"minimum": 1, "maximum": INT64_MAX},
        "max_output_tokens": {"minimum": 1, "maximum": INT64_MAX},
        "min_tokens": {"minimum": 0, "maximum": INT64_MAX},
        "logprobs": {"minimum": 0, "maximum": limits.max_logprobs},
        "top_logprobs": {"minimum": 0, "maximum": limits.max_logprobs},
    })
    return bounds


def publish_bounds(schema: dict[str, Any], limits: SamplingLimits) -> None:
    """Add the bounds to the properties of one request body's schema (in place)."""
    props = schema.get("properties", {})
    for name, keywords in parameter_bounds(limits).items():
        if name in props:
            _bound(props[name], ("number", "integer"), keywords)
    if "logit_bias" in props:
        for option in _options(props["logit_bias"]):
            values = option.get("additionalProperties")
            if isinstance(values, dict):
                values.update(LOGIT_BIAS_RANGE.json_schema())


def _options(prop: dict[str, Any]) -> list[dict[str, Any]]:
    return prop["anyOf"] if "anyOf" in prop else [prop]


def _bound(prop: dict[str, Any], types: tuple[str, ...], keywords: dict[str, Any]) -> None:
    for option in _options(prop):
        if option.get("type") in types:
            option.update(keywords)


@dataclass(frozen=True)
class Served:
    """What the document's bounds depend on besides the sampling limits: the names a request
    may give as ``model`` and the context length (``--max-model-len``)."""

    models: tuple[str, ...] = ()
    max_model_len: int | None = None
    embedding_size: int | None = None
    auto_tool_choice: bool = False  # --enable-auto-tool-choice with a --tool-call-parser
    reasoning: bool = False  # --reasoning-parser
    fim: bool = False  # a model with fill-in-the-middle tokens: completions' suffix inserts


#: The fields that count generated tokens: at most the context less one prompt token.
_OUTPUT_LENGTHS = ("max_tokens", "max_completion_tokens", "max_output_tokens", "min_tokens",
                   "n_predict")
#: Fields that hold lists of token ids.
_TOKEN_LISTS = ("stop_token_ids", "tokens")
#: Fields that hold a prompt in the four forms of ``protocol.Prompt``.
_PROMPTS = {"CompletionRequest": "prompt", "EmbeddingRequest": "input",
            "ClassificationRequest": "input"}


def publish_served(body: type, schema: dict[str, Any], limits: SamplingLimits,
                   served: Served, components: dict[str, Any]) -> None:
    """Add what the served model and the server's flags bound to request body ``body``'s
    schema (in place): the model names, the context, the vocabulary, the options accepted
    only in their neutral value, the exclusive fields."""
    from asyncengine.entrypoints.http.protocol import accepted_values

    name = body.__name__
    props = schema.get("properties", {})
    props.update(accepted_values(body))
    if served.models and "model" in props:
        props["model"] = {"anyOf": [{"enum": list(served.models)}, {"type": "null"}],
                          "description": "a served model (GET /v1/models)"}
    if served.max_model_len is not None:
        for field in _OUTPUT_LENGTHS:
            if field in props:
                _bound(props[field], ("integer",), {"maximum": served.max_model_len - 1})
    token = _token_schema(limits)
    for field in _TOKEN_LISTS:
        if field in props:
            for option in _options(props[field]):
                if option.get("type") == "array":
                    option["items"] = dict(token)
    if name == "LlamaCompletionRequest" and "prompt" in props:  # text, or token ids
        for option in _options(props["prompt"]):
            if option.get("type") == "array":
                option["items"] = dict(token)
    if name == "CompletionRequest" and served.fim and "suffix" in props:
        props["suffix"] = {"anyOf": [{"type": "string"}, {"type": "null"}],
                           "description": "text after the insertion (a code model's "
                                          "fill-in-the-middle)"}
    if name in _PROMPTS and _PROMPTS[name] in props:
        props[_PROMPTS[name]] = prompt_schema(limits)
    for option in _options(props.get("truncate_prompt_tokens", {})):
        if option.get("minimum") == -1:  # vLLM's: -1 (the context length) or a positive count
            option["not"] = {"const": 0}
    if "logit_bias" in props and limits.vocab_size:
        for option in _options(props["logit_bias"]):
            if option.get("type") == "object":
                option["propertyNames"] = {"pattern": range_pattern(limits.vocab_size - 1)}
    if name == "ResponsesRequest":
        from asyncengine.entrypoints.http.openai.responses_protocol import REFUSED_ACCEPTS

        props.update({k: v for k, v in REFUSED_ACCEPTS.items() if k in props})
        if "input" in props:
            _items_of_input(props["input"], components)
        if "tools" in props:  # function tools only (chat_tools)
            props["tools"] = {"anyOf": [{"type": "null"}, {"type": "array", "minItems": 1,
                                                          "items": {
                "type": "object", "required": ["type", "name"],
                "properties": {"type": {"const": "function"}, "name": {"type": "string"},
                               "parameters": {"type": "object"}}}}]}
    if name == "EmbeddingRequest" and served.embedding_size and "dimensions" in props:
        props["dimensions"] = {"anyOf": [{"const": served.embedding_size}, {"type": "null"}],
                               "description": "only the model's own size (no shortening)"}
    dependent = {k: v for k, v in _DEPENDENT.items() if k in props}
    if name == "CompletionRequest" and served.fim and "suffix" in props:
        dependent["suffix"] = {"anyOf": [_unset("suffix", ""), _unset("echo", False)]}
    if "stream_options" in props and "stream" in props:
        dependent["stream_options"] = {"anyOf": [_unset("stream_options"), {
            "required": ["stream"], "properties": {"stream": {"const": True}}}]}
    if dependent:
        schema["dependentSchemas"] = dependent
    if not served.auto_tool_choice and name == "ResponsesRequest" and "tool_choice" in props:
        props["tool_choice"] = {"anyOf": [
            {"enum": ["none", "required"]}, {"type": "null"},
            {"type": "object", "required": ["type", "name"], "properties": {
                "type": {"const": "function"}, "name": {"type": "string"}}}]}
    if not served.auto_tool_choice and name in ("ChatCompletionRequest", "MessagesRequest",
                                                "CountTokensRequest", "ResponsesRequest"):
        # Without a tool parser the server cannot read a call the model chose to make: no
        # "auto", and tools come with a tool choice (their default is "auto").
        if "tool_choice" in props:
            _drop_auto(props["tool_choice"], components)
        if "tools" in props:
            dependent["tools"] = {"anyOf": [_unset("tools"), {
                "required": ["tool_choice"],
                "properties": {"tool_choice": {"not": {"type": "null"}}}}]}
            schema["dependentSchemas"] = dependent
    if not served.reasoning:  # thinking needs --reasoning-parser
        if "thinking_token_budget" in props:
            props["thinking_token_budget"] = {"type": "null"}
        if "thinking" in props:
            _drop_refs(props["thinking"], {"ThinkingEnabled"})
    if "StructuredOutputs" in components:
        _exactly_one(components["StructuredOutputs"])
    if "MessageIn" in components:  # tool results are the user's, tool uses the assistant's
        def without(kind: str) -> dict[str, Any]:
            return {"properties": {"content": {"anyOf": [
                {"type": "string"},
                {"type": "array", "items": {"not": {"required": ["type"], "properties": {
                    "type": {"const": kind}}}}}]}}}

        components["MessageIn"]["if"] = {"properties": {"role": {"const": "assistant"}}}
        components["MessageIn"]["then"] = without("tool_result")
        components["MessageIn"]["else"] = without("tool_use")
    if "TextFormat" in components:  # a json_schema format carries its schema
        components["TextFormat"]["if"] = {"required": ["type"],
                                          "properties": {"type": {"const": "json_schema"}}}
        components["TextFormat"]["then"] = {"required": ["schema"],
                                            "properties": {"schema": {"type": "object"}}}
    if "ChatMessage" in components:  # tool calls are the assistant's
        components["ChatMessage"]["if"] = {"properties": {"role": {"not": {"const":
                                                                              "assistant"}}}}
        components["ChatMessage"]["then"] = {"properties": {"tool_calls": {"type": "null"}}}
    if name == "MessagesRequest" and "max_tokens" in props:  # 0: Anthropic's cache warm-up
        _bound(props["max_tokens"], ("integer",), {"minimum": 0})
    if name == "TokenizeRequest":  # exactly one of prompt, messages and (llama's) content
        forms = {"prompt": "string", "messages": "array", "content": "string"}
        schema["oneOf"] = [
            {"required": [given], "properties": {
                f: {"type": kind} if f == given else {"type": "null"} for f, kind in
                forms.items()}} for given in forms]


def _drop_auto(prop: dict[str, Any], components: dict[str, Any]) -> None:
    """``tool_choice`` without ``"auto"`` (OpenAI's string, Anthropic's ``{"type": "auto"}``):
    the server answers it only with a tool parser."""
    for option in _options(prop):
        if "enum" in option:
            option["enum"] = [v for v in option["enum"] if v != "auto"]
    _drop_refs(prop, {"ToolChoiceAuto"})


def _drop_refs(prop: dict[str, Any], names: set[str]) -> None:
    """Remove the options of a (nested, tagged) union that refer to components ``names``."""
    for option in _options(prop):
        if "anyOf" in option:
            option["anyOf"] = [o for o in option["anyOf"]
                               if o.get("$ref", "").rsplit("/", 1)[-1] not in names]
            mapping = option.get("discriminator", {}).get("mapping", {})
            for tag in [t for t, ref in mapping.items() if ref.rsplit("/", 1)[-1] in names]:
                del mapping[tag]


def _exactly_one(schema: dict[str, Any]) -> None:
    """vLLM's ``structured_outputs``: exactly one field set (not null; ``json_object`` true)."""
    keys = list(schema.get("properties", {}))

    def unset(k: str) -> dict[str, Any]:
        return {"anyOf": [{"type": "null"}, {"const": False}]} if k == "json_object" \
            else {"type": "null"}

    def chosen(k: str) -> dict[str, Any]:
        return {"const": True} if k == "json_object" else {"not": {"type": "null"}}

    schema["oneOf"] = [{"required": [k], "properties": {
        **{o: unset(o) for o in keys if o != k}, k: chosen(k)}} for k in keys]


def _unset(name: str, neutral: Any = None) -> dict[str, Any]:
    """Schema: ``name`` is left out, null, or (when given) its neutral value."""
    options: list[dict[str, Any]] = [{"type": "null"}]
    if neutral is not None:
        options.append({"const": neutral})
    return {"properties": {name: {"anyOf": options}}}


#: Fields that need another one (what the handlers check), as JSON Schema's dependentSchemas.
_DEPENDENT: dict[str, dict[str, Any]] = {
    "tool_choice": {"anyOf": [_unset("tool_choice"), {
        "required": ["tools"], "properties": {"tools": {"type": "array", "minItems": 1}}}]},
    "top_logprobs": {"anyOf": [_unset("top_logprobs"), {
        "required": ["logprobs"], "properties": {"logprobs": {"const": True}}}]},
    "continue_final_message": {"anyOf": [_unset("continue_final_message", False), {
        "required": ["add_generation_prompt"],
        "properties": {"add_generation_prompt": {"const": False}}}]},
}


def _token_schema(limits: SamplingLimits) -> dict[str, Any]:
    top = limits.vocab_size - 1 if limits.vocab_size else INT64_MAX
    return {"type": "integer", "minimum": 0, "maximum": top}


def prompt_schema(limits: SamplingLimits) -> dict[str, Any]:
    """A prompt's four forms, none empty and no list mixed (``completion_prompts``)."""
    token = _token_schema(limits)
    text = {"type": "string", "minLength": 1}

    def array(items: dict[str, Any]) -> dict[str, Any]:
        return {"type": "array", "minItems": 1, "items": items}

    return {"anyOf": [text, array(text), array(token), array(array(token))]}


def _items_of_input(prop: dict[str, Any], components: dict[str, Any]) -> None:
    """The Responses API's input items, from the Structs ``chat_messages`` converts them to."""
    import msgspec

    from asyncengine.entrypoints.http.openai.responses_protocol import INPUT_ITEMS

    schemas, defs = msgspec.json.schema_components(
        INPUT_ITEMS, ref_template="#/components/schemas/{name}")
    components.update(defs)
    for option in _options(prop):
        if option.get("type") == "array":
            option["items"] = {"anyOf": list(schemas)}


def range_pattern(top: int) -> str:
    """A regular expression of the decimal integers 0..``top`` (no leading zeros)."""
    digits = str(top)
    alternatives = ["0"] if top < 10 else ["[0-9]"]
    for width in range(2, len(digits)):  # every shorter width in full
        alternatives.append(f"[1-9][0-9]{{{width - 1}}}")
    if len(digits) > 1:  # the numbers of top's width up to top, digit by digit
        for i, d in enumerate(digits):
            low = "1" if i == 0 else "0"
            rest = len(digits) - i - 1
            if int(d) > int(low):
                tail = f"[0-9]{{{rest}}}" if rest else ""
                alternatives.append(f"{digits[:i]}[{low}-{int(d) - 1}]{tail}")
        alternatives.append(digits)
    elif top >= 1:
        alternatives = [f"[0-{top}]"]
    return "^(" + "|".join(alternatives) + ")$"
