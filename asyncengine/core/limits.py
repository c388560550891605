"""What a request may ask for: the documented range of every numeric sampling parameter, the
operator's limits (``--max-n``, ``--max-logprobs``) and the deepest JSON a request may nest.

The ranges are what the kernels can hold, rounded to values a user can remember. They are
checked by ``SamplingParams.validate`` (a ``ValueError`` naming the parameter; a 400 over
HTTP) and published in ``/openapi.json``, from this one table.

- ``temperature`` in [0, 10000]. Sampling divides float32 logits by it. At 1e4 a logit spread
  of 30 becomes 3e-3, so the distribution is already within 0.3% of uniform; past ~1e8 it is
  bit-for-bit uniform, and past 3.4e38 the temperature itself is ``inf`` in float32 and turns
  masked logits into NaN. Larger values mean nothing a user could want, so they are refused.
- ``repetition_penalty`` in [0.01, 100]: logits are divided or multiplied by it; outside this
  range float32 logits overflow (1e-50 is 0 in float32: a division by zero).
- ``presence_penalty`` and ``frequency_penalty`` in [-2, 2] and ``logit_bias`` values in
  [-100, 100], as OpenAI documents them; ``top_p`` in (0, 1], ``min_p`` in [0, 1].
- ``seed`` fits int64, and so does ``seed + n - 1`` (sample ``i`` of ``n`` uses ``seed + i``).
- ``top_k``: -1 or 0 disable it; a value past the vocabulary means "all tokens" (the server
  clamps it to the vocabulary size), so only values below -1 are refused.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1

#: The deepest nesting of arrays and objects a request body, or a JSON schema inside it, may
#: have. Real schemas stay far below; deeper ones cost seconds to compile (xgrammar) and
#: thousands of levels overflow the recursion limit of JSON coders.
MAX_JSON_DEPTH = 64

DEFAULT_MAX_N = 128
DEFAULT_MAX_LOGPROBS = 20


@dataclass(frozen=True)
class Range:
    """A closed interval, open at the low end when ``low_open``."""

    low: float
    high: float
    low_open: bool = False

    def __contains__(self, value: float) -> bool:
        above = value > self.low if self.low_open else value >= self.low
        return above and value <= self.high

    def __str__(self) -> str:
        return f"{'(' if self.low_open else '['}{_num(self.low)}, {_num(self.high)}]"

    def json_schema(self) -> dict[str, float]:
        """The bounds as JSON Schema (2020-12) keywords."""
        low = "exclusiveMinimum" if self.low_open else "minimum"
        return {low: self.low, "maximum": self.high}


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


MAX_TEMPERATURE = 1e4

#: The float parameters of ``SamplingParams`` and their ranges.
FLOAT_RANGES: dict[str, Range] = {
    "temperature": Range(0.0, MAX_TEMPERATURE),
    "top_p": Range(0.0, 1.0, low_open=True),
    "min_p": Range(0.0, 1.0),
    "presence_penalty": Range(-2.0, 2.0),
    "frequency_penalty": Range(-2.0, 2.0),
    "repetition_penalty": Range(0.01, 100.0),
}
LOGIT_BIAS_RANGE = Range(-100.0, 100.0)
SEED_RANGE = Range(INT64_MIN, INT64_MAX)


@dataclass(frozen=True)
class SamplingLimits:
    """The limits that depend on the server: its flags and its model's vocabulary."""

    max_n: int = DEFAULT_MAX_N
    max_logprobs: int = DEFAULT_MAX_LOGPROBS
    vocab_size: int | None = None


def show(value: Any) -> str:
    """``value`` for an error message: huge integers and long reprs shortened."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**30:
        return f"a {'negative ' if value < 0 else ''}{value.bit_length()}-bit integer"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def as_finite_float(name: str, value: Any) -> float:
    """``value`` as a finite float, or a ValueError naming ``name``."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must be a number, got {value!r}")
    try:
        number = float(value)
    except (TypeError, ValueError, OverflowError):
        raise ValueError(f"{name} must be a finite number, got {show(value)}") from None
    if not math.isfinite(number):
        raise ValueError(f"{name} must be a finite number, got {show(value)}")
    return number


def _children(value: Any) -> Iterator[Any]:
    if isinstance(value, dict):
        return iter(value.values())
    if isinstance(value, list | tuple):
        return iter(value)
    return iter(())


def json_depth_exceeds(value: Any, limit: int = MAX_JSON_DEPTH) -> bool:
    """True if ``value`` (decoded JSON: dicts, lists, scalars) nests arrays and objects more
    than ``limit`` levels deep. Iterative: any depth is safe to check."""
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if not isinstance(node, dict | list | tuple):
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in _children(node))
    return False
