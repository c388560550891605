"""Structured outputs: the backend contract and the manager the engine talks to.

A request that asks for structured output (``SamplingParams.structured_outputs``) gets a
:class:`Grammar` — a matcher over the model's vocabulary — in ``Request.grammar``. Each step:

1. while the device runs the forward pass, the loop fills one bitmask row per sampled row
   (:meth:`StructuredOutputManager.fill_bitmask`);
2. the worker applies the bitmask to the logits before sampling, so disallowed tokens get
   ``-inf`` (:meth:`StructuredOutputManager.apply_bitmask`);
3. after sampling, the scheduler calls ``request.grammar.accept_token(token)``, and
   ``Request.check_stop`` finishes a request whose grammar ``is_terminated()`` (finish reason
   ``"stop"``).

Backends are plugins (``register_structured_output_backends``); the default is ``xgrammar``
(``asyncengine/plugins/xgrammar_backend.py``). A backend class is constructed as
``cls(tokenizer, vocab_size)``.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import anyio
import anyio.to_thread

if TYPE_CHECKING:
    import torch

    from asyncengine.sampling_params import StructuredOutputsParams
    from asyncengine.tokenization import Tokenizer

#: Bumped when the contract below changes incompatibly (see docs/plugins.md).
STRUCTURED_OUTPUT_API_VERSION = 1

#: The kinds of constraint a backend compiles (``StructuredOutputsParams.kind``).
KINDS = ("json", "json_object", "regex", "choice", "grammar")


class Grammar(ABC):
    """One request's matcher state over the model's vocabulary.

    The grammar starts in its initial state. Its end is marked by the model's end-of-sequence
    token: once the constrained text is complete the bitmask allows an EOS token (alone, when
    the grammar cannot continue); accepting it terminates the grammar. A Grammar is used from
    the engine's event loop only, never from two threads at once.
    """

    @abstractmethod
    def accept_token(self, token_id: int) -> bool:
        """Advance by one sampled token. Returns False (and keeps the state) if the grammar
        does not allow the token here or has already terminated."""

    @abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into ``bitmask[row]`` (a row from the backend's
        :meth:`StructuredOutputBackend.allocate_bitmask`; bit ``t`` set = token ``t``
        allowed). Does not change the state."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """True once the grammar accepted its end (an EOS token after a complete match)."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (speculative decoding, jump-forward)."""

    @abstractmethod
    def reset(self) -> None:
        """Go back to the initial state."""

    @abstractmethod
    def fresh(self) -> Grammar:
        """A new, independent Grammar for the same compiled grammar, in its initial state.
        Cheap: this is how the manager hands each request its own matcher from one cached
        compilation."""


class StructuredOutputBackend(ABC):
    """Compiles constraints into :class:`Grammar` objects and masks logits with them.

    ``tokenizer`` is the engine's ``asyncengine.tokenization.Tokenizer`` (the backend may read
    ``tokenizer.hf``, the transformers tokenizer, and ``tokenizer.eos_token_ids``);
    ``vocab_size`` is the MODEL's vocabulary size (the width of the logits), which may exceed
    the tokenizer's: ids past the tokenizer's vocabulary are never allowed.
    ``compile_grammar`` is called from worker threads (possibly several at once) and must be
    thread-safe; everything else runs on the event loop or, for ``apply_bitmask``, on the
    device worker.
    """

    @abstractmethod
    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None: ...

    @abstractmethod
    def compile_grammar(self, kind: str, spec: Any) -> Grammar:
        """Compile one constraint. ``kind`` is one of :data:`KINDS`; ``spec`` is a JSON schema
        (dict or str) for ``json``, None for ``json_object`` (any JSON object), a regular
        expression for ``regex``, a list of strings for ``choice``, an EBNF grammar for
        ``grammar``. Raises ValueError, with the backend's message, for an invalid spec."""

    @abstractmethod
    def allocate_bitmask(self, num_rows: int) -> torch.Tensor:
        """A CPU bitmask of ``num_rows`` rows with every token allowed."""

    def fill_bitmasks(self, grammars: list[Grammar | None], bitmask: torch.Tensor) -> None:
        """Fill ``bitmask[row]`` for each row whose grammar is not None and not terminated
        (other rows keep allowing everything). A backend may override this to fill rows in
        parallel; the default asks each grammar in turn."""
        fill_rows(grammars, bitmask)

    @abstractmethod
    def apply_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor,
                      rows: list[int] | None = None) -> None:
        """Set ``logits[r, t] = -inf`` in place for every token ``t`` the bitmask disallows,
        for each row ``r`` in ``rows`` (all rows if None). ``logits`` may live on any device;
        ``bitmask`` is on the CPU and has one row per logits row."""


def _cache_key(params: StructuredOutputsParams) -> tuple[str, str]:
    # Not params.key(): it sorts a schema's keys, but property order is meaningful here (the
    # output follows the schema's order), so two orders are two grammars.
    spec = params.spec
    return (params.kind, spec if isinstance(spec, str) else json.dumps(spec))


def fill_rows(grammars: list[Grammar | None], bitmask: torch.Tensor) -> None:
    """Row by row: :meth:`StructuredOutputBackend.fill_bitmasks`' default."""
    for row, grammar in enumerate(grammars):
        if grammar is not None and not grammar.is_terminated():
            grammar.fill_bitmask(bitmask, row)


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
                        self.backend.compile_grammar, params.kind, params.spec)
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
