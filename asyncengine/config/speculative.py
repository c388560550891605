"""``--speculative-config``: vLLM's JSON for speculative decoding, read into
:class:`SpeculativeSettings`.

Two methods:

* ``{"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": N,
  "prompt_lookup_min": M}``: prompt lookup, drafts copied from the request's own tokens;
* ``{"method": "draft_model", "model": PATH, "num_speculative_tokens": K}``: a small model of
  the same vocabulary proposes the drafts.

``num_speculative_tokens_per_batch_size`` (vLLM's ``[[start, end, k], ...]``, inclusive
ranges of running requests) sets k by batch size; 0 turns speculation off. Without it
(:func:`default_ranges`), k applies to one request, at most 4 drafts to 2 and 3 to 3-4
(:data:`DEFAULT_MAX_BATCH`), and speculation is off above: each verification row costs a part
of a step (``docs/speculative.md``), while a larger batch already fills the device, so the
rows a batch can afford shrink as it grows; and a request waiting for its verification
leaves the next step, which splits a batch's steps. (From the grounded benchmark's outputs,
replayed against the measured row cost, the best k was 6-8 for one request, 2-6 for two, 2-3
for four; measured at concurrency 8 with k=2, speculation cost 3-10% a round.)
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

METHODS = ("ngram", "draft_model")
#: Running requests up to which speculation is on when no per-batch-size table is given.
DEFAULT_MAX_BATCH = 4


def default_ranges(k: int) -> tuple[tuple[int, int, int], ...]:
    """The per-batch-size table without ``num_speculative_tokens_per_batch_size``."""
    return ((1, 1, k), (2, 2, min(k, 4)), (3, DEFAULT_MAX_BATCH, min(k, 3)))
_FLAG = "--speculative-config"
_KEYS = {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
         "model", "num_speculative_tokens_per_batch_size", "draft_tensor_parallel_size",
         "quantization", "max_model_len", "revision"}
# Keys vLLM accepts that change nothing here; anything else is an error naming the key.
_IGNORED = {"draft_tensor_parallel_size", "quantization", "max_model_len", "revision"}


@dataclass
class SpeculativeConfig:
    speculative_config: dict[str, Any] | str | None = field(default=None, metadata={
        "help": "speculative decoding, vLLM's JSON: '{\"method\": \"ngram\", "
                "\"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4, "
                "\"prompt_lookup_min\": 2}' or '{\"method\": \"draft_model\", \"model\": PATH, "
                "\"num_speculative_tokens\": 4}'; optional "
                "\"num_speculative_tokens_per_batch_size\": [[start, end, k], ...] (default: "
                f"k for 1 running request, at most 4 for 2, 3 for 3-{DEFAULT_MAX_BATCH}, off "
                "above); default: off"})


@dataclass(frozen=True)
class SpeculativeSettings:
    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int = 0
    prompt_lookup_min: int = 0
    model: str | None = None
    # (first, last, k): inclusive ranges of the number of running requests.
    per_batch_size: tuple[tuple[int, int, int], ...] = ()

    def k_for_batch(self, num_running: int) -> int:
        """Draft tokens per request when ``num_running`` requests run (0: speculation off)."""
        for first, last, k in self.per_batch_size:
            if first <= num_running <= last:
                return k
        return 0

    @property
    def max_k(self) -> int:
        return max((k for _, _, k in self.per_batch_size), default=0)


def _int(d: dict[str, Any], key: str, default: int | None, low: int) -> int:
    value = d.get(key, default)
    if value is None:
        raise ValueError(f"{_FLAG}: {key!r} is required for method {d.get('method')!r}")
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{_FLAG}: {key!r} must be an integer >= {low}, got {value!r}")
    return value


def parse_speculative(value: dict[str, Any] | str | None) -> SpeculativeSettings | None:
    """The settings of ``--speculative-config`` (None: off). A ``ValueError`` names the key."""
    if value is None or value == "":
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise ValueError(f"{_FLAG}: not valid JSON ({e}): {value!r}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{_FLAG}: must be a JSON object, got {value!r}")
    unknown = sorted(set(value) - _KEYS)
    if unknown:
        raise ValueError(f"{_FLAG}: unknown key {unknown[0]!r} (known: "
                         f"{', '.join(sorted(_KEYS - _IGNORED))})")
    method = value.get("method")
    if method is None and value.get("model") is not None:
        method = "ngram" if value["model"] in ("ngram", "[ngram]") else "draft_model"
    if method not in METHODS:
        raise ValueError(f"{_FLAG}: 'method' must be one of {', '.join(METHODS)}, got "
                         f"{method!r}")
    d = {**value, "method": method}
    k = _int(d, "num_speculative_tokens", None, 1)
    if k > 32:
        raise ValueError(f"{_FLAG}: 'num_speculative_tokens' must be at most 32, got {k}")
    lookup_max = lookup_min = 0
    model = None
    if method == "ngram":
        lookup_max = _int(d, "prompt_lookup_max", 4, 1)
        lookup_min = _int(d, "prompt_lookup_min", min(2, lookup_max), 1)
        if lookup_min > lookup_max:
            raise ValueError(f"{_FLAG}: 'prompt_lookup_min' ({lookup_min}) must not exceed "
                             f"'prompt_lookup_max' ({lookup_max})")
        if lookup_max > 16:
            raise ValueError(f"{_FLAG}: 'prompt_lookup_max' must be at most 16, got "
                             f"{lookup_max}")
    else:
        model = d.get("model")
        if not isinstance(model, str) or not model:
            raise ValueError(f"{_FLAG}: 'model' (a path) is required for method draft_model")
    table = d.get("num_speculative_tokens_per_batch_size")
    if table is None:
        ranges: tuple[tuple[int, int, int], ...] = default_ranges(k)
    else:
        ranges = _ranges(table, k)
    return SpeculativeSettings(method, k, lookup_max, lookup_min, model, ranges)


def _ranges(table: Any, k_max: int) -> tuple[tuple[int, int, int], ...]:
    key = "num_speculative_tokens_per_batch_size"
    if not isinstance(table, list) or not table:
        raise ValueError(f"{_FLAG}: {key!r} must be a non-empty list of [start, end, k], "
                         f"got {table!r}")
    out = []
    for entry in table:
        if (not isinstance(entry, list | tuple) or len(entry) != 3
                or any(isinstance(x, bool) or not isinstance(x, int) for x in entry)):
            raise ValueError(f"{_FLAG}: {key!r}: each entry must be [start, end, k] of "
                             f"integers, got {entry!r}")
        first, last, k = entry
        if first < 1 or last < first:
            raise ValueError(f"{_FLAG}: {key!r}: [start, end] must have 1 <= start <= end, "
                             f"got {entry!r}")
        if not 0 <= k <= k_max:
            raise ValueError(f"{_FLAG}: {key!r}: k must be in [0, num_speculative_tokens "
                             f"{k_max}], got {entry!r}")
        out.append((first, last, k))
    out.sort()
    for (_, a_last, _), (b_first, _, _) in zip(out, out[1:], strict=False):
        if b_first <= a_last:
            raise ValueError(f"{_FLAG}: {key!r}: the ranges overlap at batch size {b_first}")
    return tuple(out)
