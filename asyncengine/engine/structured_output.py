"""StructuredOutputManager: what the engine uses of a structured-output backend.

It compiles constraints off the event loop (cached, shared between concurrent callers) and
fills and applies the per-step bitmasks through the backend (``contract.py``).
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import anyio
import anyio.to_thread

from asyncengine.ext.contracts.structured_output import Grammar, StructuredOutputBackend, fill_rows

if TYPE_CHECKING:
    import torch

    from asyncengine.core.sampling_params import StructuredOutputsParams


_NOUNS = {"json": "JSON schema", "json_object": "JSON object", "regex": "regex",
          "choice": "choice", "grammar": "grammar"}


def _cache_key(params: StructuredOutputsParams) -> tuple[str, str]:
    # Not params.key(): it sorts a schema's keys, but property order is meaningful here (the
    # output follows the schema's order), so two orders are two grammars.
    spec = params.spec
    return (params.kind, spec if isinstance(spec, str) else json.dumps(spec))


@dataclass
class _Compilation:
    """A cache entry: finished (``grammar`` or ``error`` set) once ``done`` is set."""

    done: anyio.Event = field(default_factory=anyio.Event)
    grammar: Grammar | None = None
    error: BaseException | None = None


class StructuredOutputManager:
    """What the engine uses: compiles (off the event loop, cached) and fills/applies bitmasks.

    Engine integration: ``await compile(params)`` once per sample (``n`` times for ``n > 1``;
    each call returns a new matcher) before queueing, an invalid spec raising ValueError; each
    step ``fill_bitmask`` on the loop while the forward pass runs, ``apply_bitmask`` in the
    worker before sampling; after sampling, ``request.grammar.accept_token(token)``.

    The cache is keyed by the kind and the spec as given and holds pristine compiled
    grammars; every :meth:`compile` returns a fresh matcher (:meth:`Grammar.fresh`), so the
    ``n`` samples of a request, or many requests with one schema, compile once. Concurrent
    compilations of one key share a single compilation. Invalid specs are not cached.
    """

    @classmethod
    def make(cls, backend_cls: type, tokenizer: Any, vocab_size: int) -> StructuredOutputManager:
        """The manager over a new ``backend_cls(tokenizer, vocab_size)``."""
        return cls(backend_cls(tokenizer, vocab_size))

    def __init__(self, backend: StructuredOutputBackend, *, max_cached: int = 1024) -> None:
        if max_cached < 1:
            raise ValueError(f"max_cached must be at least 1, got {max_cached}")
        self.backend = backend
        self.max_cached = max_cached
        self._cache: OrderedDict[tuple[str, str], _Compilation] = OrderedDict()

    async def compile(self, params: StructuredOutputsParams) -> Grammar:
        """A new Grammar for ``params``. Raises ValueError for an invalid spec."""
        key = _cache_key(params)
        entry = self._cache.get(key)
        if entry is not None and entry.grammar is not None:
            # Not awaiting ``done``: the entry may come from another event loop (LLM.generate
            # runs one per call); only in-flight entries, made on this loop, are waited on.
            self._cache.move_to_end(key)
            return entry.grammar.fresh()
        if entry is None:
            entry = self._cache[key] = _Compilation()
            # Shielded: waiters on this entry must be woken even if this caller is cancelled.
            with anyio.CancelScope(shield=True):
                try:
                    entry.grammar = await anyio.to_thread.run_sync(
                        self._compile_checked, params.kind, params.spec)
                except Exception as e:
                    entry.error = e
                    del self._cache[key]
                finally:
                    entry.done.set()
            self._evict()
        else:
            await entry.done.wait()
        if entry.grammar is None:
            raise entry.error or RuntimeError("grammar compilation did not finish")
        return entry.grammar.fresh()

    def _compile_checked(self, kind: str, spec: object) -> Grammar:
        """Compile, and refuse a constraint that allows no token at all from its start (a
        schema like ``{"$ref": "#"}``): no output could ever satisfy it."""
        grammar = self.backend.compile_grammar(kind, spec)
        bitmask = self.backend.allocate_bitmask(1)
        grammar.fill_bitmask(bitmask, 0)
        if not bool(bitmask.any()):
            raise ValueError(f"invalid {_NOUNS.get(kind, kind)}: no output can satisfy it "
                             "(it allows no token, not even the end of the text)")
        return grammar

    def _evict(self) -> None:
        while len(self._cache) > self.max_cached:
            oldest = next(iter(self._cache))
            if not self._cache[oldest].done.is_set():
                break
            del self._cache[oldest]

    @property
    def num_cached(self) -> int:
        return len(self._cache)

    def fill_bitmask(self, grammars: list[Grammar | None]) -> torch.Tensor | None:
        """One bitmask row per sampled row of the step, in order; rows whose grammar is None
        (or already terminated) allow every token. None when no row is constrained."""
        if all(g is None for g in grammars):
            return None
        bitmask = self.backend.allocate_bitmask(len(grammars))
        # Backends need not subclass StructuredOutputBackend (duck typing is allowed).
        getattr(self.backend, "fill_bitmasks", fill_rows)(grammars, bitmask)
        return bitmask

    def apply_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        """Mask ``logits`` (one row per bitmask row) in place; on the device worker."""
        self.backend.apply_bitmask(logits, bitmask, None)
