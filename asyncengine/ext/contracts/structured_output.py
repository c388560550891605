"""Structured outputs: the backend contract (public as ``asyncengine.plugins``; the manager
the engine uses is ``asyncengine/engine/structured_output.py``).

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
(``asyncengine/builtins/xgrammar.py``). A backend class is constructed as
``cls(tokenizer, vocab_size)``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from asyncengine.text.tokenizer import Tokenizer

#: Bumped when the contract below changes incompatibly (see docs/plugins.md).
#: 2: imported from ``asyncengine.plugins`` (the methods did not change; 1 is still accepted).
STRUCTURED_OUTPUT_API_VERSION = 2

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

    ``tokenizer`` is the engine's ``asyncengine.text.tokenizer.Tokenizer`` (the backend may read
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


def fill_rows(grammars: list[Grammar | None], bitmask: torch.Tensor) -> None:
    """Row by row: :meth:`StructuredOutputBackend.fill_bitmasks`' default."""
    for row, grammar in enumerate(grammars):
        if grammar is not None and not grammar.is_terminated():
            grammar.fill_bitmask(bitmask, row)
