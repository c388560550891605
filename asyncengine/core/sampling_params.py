"""Per-request generation parameters (the offline API's and the server's common currency)."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any


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
        import json as _json

        spec = self.spec
        if not isinstance(spec, str):
            spec = _json.dumps(spec)
        return (self.kind, spec or "")


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

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or []) if s]
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k is None or self.top_k < 0:
            self.top_k = 0
        self.validate()

    def validate(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"{name} {why}")

        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", f"must be at least 1, got {self.n}")
        if self.temperature < 0:
            raise bad("temperature", f"must be non-negative, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise bad("min_p", f"must be in [0, 1], got {self.min_p}")
        if not -2 <= self.presence_penalty <= 2:
            raise bad("presence_penalty", f"must be in [-2, 2], got {self.presence_penalty}")
        if not -2 <= self.frequency_penalty <= 2:
            raise bad("frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty}")
        if self.repetition_penalty <= 0:
            raise bad("repetition_penalty", f"must be positive, got {self.repetition_penalty}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise bad("max_tokens", f"must be at least 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise bad("min_tokens", f"must be non-negative, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"({self.min_tokens}) must not exceed max_tokens "
                      f"({self.max_tokens})")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and not 0 <= v <= 20:
                raise bad(name, f"must be in [0, 20], got {v}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad("seed", "must be an integer")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    def clone(self) -> SamplingParams:
        return copy.deepcopy(self)
