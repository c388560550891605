"""The ``auto`` structured-output backend: per request, the backend that enforces its
constraint, as vLLM's ``auto`` chooses.

xgrammar (the default) serves every constraint it enforces. A constraint xgrammar refuses to
compile (a regex with ``\\p{L}`` classes or ``(?i)``, say), or a JSON schema using a keyword
xgrammar accepts without enforcing it (:data:`XGRAMMAR_UNENFORCED`: ``uniqueItems``,
``contains``, ``not``, ``if``...), goes to llguidance when it is registered (the
``asyncengine-llguidance`` distribution, ``plugins/llguidance``). When neither enforces it
(llguidance refuses those keywords too, today), or llguidance is not installed, the request
is refused with a message that says so, never served unenforced.

Both backends fill the same bitmask format (int32, bit ``t`` = token ``t``), so one batch
mixes their grammars; the bitmask is xgrammar's and so is applying it.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

from asyncengine.builtins.xgrammar import XGrammarBackend, XGrammarGrammar
from asyncengine.ext import registry
from asyncengine.plugins import Grammar, StructuredOutputBackend, fill_rows

if TYPE_CHECKING:
    import torch

    from asyncengine.plugins import Tokenizer

#: JSON-schema keywords xgrammar 0.2 compiles without enforcing them (checked by sampling:
#: ``["b", "b"]`` under uniqueItems, ``[1]`` under ``contains: {const: 3}``).
XGRAMMAR_UNENFORCED = frozenset({
    "uniqueItems", "contains", "minContains", "maxContains", "dependentRequired",
    "dependentSchemas", "not", "if", "then", "else",
})
FALLBACK = "llguidance"


def xgrammar_unenforced(schema: Any) -> list[str]:
    """The keywords of ``schema`` (anywhere in it) that xgrammar would not enforce."""
    found: set[str] = set()
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
        elif isinstance(node, dict):
            for key, value in node.items():
                if key in ("enum", "const", "default", "examples"):
                    continue
                if key in XGRAMMAR_UNENFORCED:
                    found.add(key)
                if key in ("properties", "patternProperties", "$defs", "definitions",
                           "dependentSchemas") and isinstance(value, dict):
                    stack.extend(value.values())  # (property names are not keywords)
                else:
                    stack.append(value)
    return sorted(found)


class AutoBackend(StructuredOutputBackend):
    """xgrammar, and llguidance for what xgrammar does not enforce (module docstring)."""

    contract_version = 2
    #: The plugin manager to find llguidance in (None: the process-wide one); the engine
    #: binds its own with :meth:`for_plugin_manager`.
    plugin_manager: Any = None

    @classmethod
    def for_plugin_manager(cls, plugin_manager: Any) -> type[AutoBackend]:
        return type(cls.__name__, (cls,), {"plugin_manager": plugin_manager,
                                           "__module__": cls.__module__})

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self.primary = XGrammarBackend(tokenizer, vocab_size)
        self.vocab_size = vocab_size
        self._tokenizer = tokenizer
        self.fallback_cls = registry.registered(
            "structured_output_backends", self.plugin_manager).get(FALLBACK)
        self._fallback: StructuredOutputBackend | None = None
        self._lock = threading.Lock()

    def fallback(self) -> StructuredOutputBackend | None:
        """llguidance, built on first need (it wraps the tokenizer: about a second)."""
        if self.fallback_cls is None:
            return None
        with self._lock:  # compile_grammar runs in several threads
            if self._fallback is None:
                self._fallback = self.fallback_cls(self._tokenizer, self.vocab_size)
            return self._fallback

    def compile_grammar(self, kind: str, spec: Any) -> Grammar:
        unenforced = xgrammar_unenforced(spec) if kind == "json" else []
        error: ValueError | None = None
        if not unenforced:
            try:
                return self.primary.compile_grammar(kind, spec)
            except ValueError as e:
                error = e
        fallback = self.fallback()
        if fallback is None:
            if error is not None:
                raise error
            raise ValueError(
                f"invalid JSON schema: xgrammar does not enforce {', '.join(unenforced)}; "
                f"install the llguidance backend (pip install asyncengine-llguidance, "
                f"plugins/llguidance) for --structured-output-backend auto to serve it")
        try:
            return fallback.compile_grammar(kind, spec)
        except ValueError as e:
            if error is not None:
                raise error from None
            raise ValueError(f"invalid JSON schema: xgrammar does not enforce "
                             f"{', '.join(unenforced)}, and llguidance refuses it: {e}") from None

    def allocate_bitmask(self, num_rows: int) -> torch.Tensor:
        return self.primary.allocate_bitmask(num_rows)

    def fill_bitmasks(self, grammars: list[Grammar | None], bitmask: torch.Tensor) -> None:
        if all(g is None or isinstance(g, XGrammarGrammar) for g in grammars):
            self.primary.fill_bitmasks(grammars, bitmask)  # batched on xgrammar's threads
        else:
            fill_rows(grammars, bitmask)

    def apply_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor,
                      rows: list[int] | None = None) -> None:
        self.primary.apply_bitmask(logits, bitmask, rows)
