"""Per-request generation parameters (the offline API's and the server's common currency)."""

from __future__ import annotations

import copy
import enum
import json as _json
from dataclasses import dataclass, field
from typing import Any

from asyncengine.core.limits import (
    FLOAT_RANGES,
    INT64_MAX,
    INT64_MIN,
    LOGIT_BIAS_RANGE,
    MAX_JSON_DEPTH,
    SamplingLimits,
    as_finite_float,
    json_depth_exceeds,
    show,
)


@dataclass
class StructuredOutputsParams:
    """A constraint on the output. Exactly one of the fields is set.

    ``json`` is a JSON schema (dict or string); ``json_object`` asks for any JSON object;
    ``regex`` a regular expression the whole output must match; ``choice`` a list of strings
    the output must equal one of; ``grammar`` an EBNF (GBNF) grammar.
    """

    json: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        kinds = [self.json is not None, self.json_object, self.regex is not None,
                 self.choice is not None, self.grammar is not None]
        if sum(kinds) != 1:
            raise ValueError(
                "structured outputs need exactly one of json, json_object, regex, choice, grammar"
            )
        if self.choice is not None and (
            not self.choice or not all(isinstance(c, str) for c in self.choice)
        ):
            raise ValueError("structured outputs 'choice' must be a non-empty list of strings")
        if self.json is not None and _schema_too_deep(self.json):
            raise ValueError(f"the JSON schema nests more than {MAX_JSON_DEPTH} levels of "
                             "arrays and objects")

    @property
    def kind(self) -> str:
        for name in ("json", "regex", "choice", "grammar"):
            if getattr(self, name) is not None:
                return name
        return "json_object"

    @property
    def spec(self) -> Any:
        return None if self.json_object else getattr(self, self.kind)

    def key(self) -> tuple[str, str]:
        """A hashable key for the grammar cache (key order matters: it is the output's)."""
        spec = self.spec
        if not isinstance(spec, str):
            spec = _json.dumps(spec)
        return (self.kind, spec or "")


def _schema_too_deep(schema: dict[str, Any] | str) -> bool:
    if isinstance(schema, str):
        try:
            schema = _json.loads(schema)
        except RecursionError:
            return True
        except ValueError:  # not JSON: the backend names the error
            return False
    return json_depth_exceeds(schema, MAX_JSON_DEPTH)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _token_id(key: Any) -> int | None:
    """A logit_bias key as a token id: an int, or a string holding one (OpenAI's keys)."""
    if _is_int(key):
        return key
    if isinstance(key, str):
        try:
            return int(key)
        except ValueError:
            return None
    return None


class RequestOutputKind(enum.IntEnum):
    """What each output of a stream holds (vLLM's names and values): everything so far
    (``CUMULATIVE``, the default), only what is new since the last one (``DELTA``: a long
    stream then costs O(new tokens) per output), or nothing until the last one
    (``FINAL_ONLY``)."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass
class SamplingParams:
    """How to sample one request. Defaults match vLLM / OpenAI.

    ``temperature == 0`` means greedy. ``top_k <= 0`` (or -1) disables top-k; ``top_p == 1``
    and ``min_p == 0`` disable those filters. ``logprobs`` is the number of top alternatives
    returned with each sampled token (0 returns only the sampled token's logprob, None none);
    ``prompt_logprobs`` likewise for prompt tokens.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    # Reasoning models (the server sets these from --reasoning-parser): the token ids of the
    # tag that ends the reasoning. With them, ``structured_outputs`` constrains only what
    # follows the tag, and ``thinking_token_budget`` (vLLM's name) forces the tag after that
    # many reasoning tokens.
    reasoning_end_token_ids: list[int] | None = None
    thinking_token_budget: int | None = None
    # What ``AsyncEngine.generate`` yields (vLLM's ``output_kind``).
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or []) if s]
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k is None or self.top_k == -1:
            self.top_k = 0
        self.validate()

    def validate(self, limits: SamplingLimits | None = None) -> None:
        """Raise ValueError, naming the parameter, for a value outside its documented range
        (``asyncengine.core.limits``). ``limits`` adds the server's: ``max_n``,
        ``max_logprobs`` and the vocabulary (``logit_bias`` ids); the engine passes them."""

        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"{name} {why}")

        if not _is_int(self.n) or self.n < 1:
            raise bad("n", f"must be at least 1, got {show(self.n)}")
        if limits is not None and self.n > limits.max_n:
            raise bad("n", f"must be at most {limits.max_n} (--max-n), got {show(self.n)}")
        for name, allowed in FLOAT_RANGES.items():
            value = as_finite_float(name, getattr(self, name))
            if value not in allowed:
                raise bad(name, f"must be in {allowed}, got {value:g}")
        if not _is_int(self.top_k) or not -1 <= self.top_k <= INT64_MAX:
            raise bad("top_k", "must be -1 or 0 (disabled) or a positive integer (values past "
                      f"the vocabulary size mean all tokens), got {show(self.top_k)}")
        if self.max_tokens is not None and (not _is_int(self.max_tokens)
                                            or not 1 <= self.max_tokens <= INT64_MAX):
            raise bad("max_tokens", f"must be at least 1 (and fit in 64 bits), got "
                      f"{show(self.max_tokens)}")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= INT64_MAX:
            raise bad("min_tokens", f"must be non-negative (and fit in 64 bits), got "
                      f"{show(self.min_tokens)}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"({show(self.min_tokens)}) must not exceed max_tokens "
                      f"({show(self.max_tokens)})")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is None:
                continue
            if not _is_int(v) or v < 0:
                raise bad(name, f"must be a non-negative integer, got {show(v)}")
            if limits is not None and v > limits.max_logprobs:
                raise bad(name, f"must be in [0, {limits.max_logprobs}] (--max-logprobs), "
                          f"got {show(v)}")
        self._validate_seed()
        self._validate_logit_bias(limits)
        if self.thinking_token_budget is not None:
            if not _is_int(self.thinking_token_budget) or not \
                    0 <= self.thinking_token_budget <= INT64_MAX:
                raise bad("thinking_token_budget", "must be a non-negative integer, got "
                          f"{show(self.thinking_token_budget)}")
        if self.reasoning_end_token_ids is not None and (
                not self.reasoning_end_token_ids
                or any(not _is_int(t) or t < 0 for t in self.reasoning_end_token_ids)):
            raise bad("reasoning_end_token_ids", "must be a non-empty list of token ids")
        if any(not _is_int(t) for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be integers")
        vocab = limits.vocab_size if limits is not None else None
        for t in self.stop_token_ids:
            if t < 0 or (vocab is not None and t >= vocab):
                top = f"0..{vocab - 1}" if vocab is not None else "non-negative"
                raise bad("stop_token_ids", f"must be token ids ({top}), got {show(t)}")

    def _validate_seed(self) -> None:
        if self.seed is None:
            return
        if not _is_int(self.seed):
            raise ValueError(f"seed must be an integer, got {show(self.seed)}")
        if not INT64_MIN <= self.seed <= INT64_MAX:
            raise ValueError(f"seed must fit in 64 bits: [{INT64_MIN}, {INT64_MAX}], got "
                             f"{show(self.seed)}")
        if self.seed + self.n - 1 > INT64_MAX:
            raise ValueError(f"seed + n - 1 must fit in 64 bits (sample i of n uses seed + i): "
                             f"at most {INT64_MAX}, got {show(self.seed)} + {self.n - 1}")

    def _validate_logit_bias(self, limits: SamplingLimits | None) -> None:
        vocab = limits.vocab_size if limits is not None else None
        for key, bias in (self.logit_bias or {}).items():
            token = _token_id(key)
            if token is None or token < 0 or (vocab is not None and token >= vocab):
                top = f"0..{vocab - 1}" if vocab is not None else "non-negative"
                raise ValueError(f"logit_bias: token id {show(key)} is out of vocabulary ({top})")
            value = as_finite_float("logit_bias", bias)
            if value not in LOGIT_BIAS_RANGE:
                raise ValueError(f"logit_bias values must be in {LOGIT_BIAS_RANGE}, got "
                                 f"{value:g}")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    def clone(self) -> SamplingParams:
        return copy.deepcopy(self)
