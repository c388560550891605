"""The validated ranges of the generation parameters, as JSON Schema bounds in /openapi.json.

They come from the same table ``SamplingParams.validate`` checks (``asyncengine.core.limits``)
and from the server's own limits (``--max-n``, ``--max-logprobs``), so the document states
exactly what the server refuses with a 400.
"""

from __future__ import annotations

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
