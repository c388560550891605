"""LLGuidanceBackend: JSON schemas, regexes, choices and Lark/GBNF grammars with llguidance
(Microsoft's Earley-parser based constrained decoding, the Rust library vLLM calls
"guidance").

Facts this relies on (llguidance >= 1.0): an ``LLMatcher`` consuming a disallowed token goes
into an error state, so :meth:`LLGuidanceGrammar.accept_token` asks ``validate_tokens`` first
and refuses without changing the state; the matcher reports ``is_stopped()`` as soon as the
grammar cannot continue (before any EOS), while the engine's contract ends a grammar when it
accepts an EOS token: the grammar here counts as terminated once it accepted one. The
tokenizer is wrapped once per backend (about a second) with the engine's EOS tokens and the
model's vocabulary size; ids past the tokenizer's vocabulary are never allowed. The bitmask is
xgrammar's format too (int32, bit ``t`` of row ``r`` = token ``t`` allowed), which is what
lets ``auto`` mix the two backends in one batch.

JSON is generated like xgrammar's: no free whitespace, ``", "`` between items and ``": "``
after keys, and objects have only the properties the schema names unless it allows others
(:func:`strict`).
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

import llguidance
import llguidance.hf
import torch
from llguidance.gbnf_to_lark import any_to_lark

from asyncengine.plugins import Grammar, StructuredOutputBackend

if TYPE_CHECKING:
    from asyncengine.plugins import Tokenizer

#: How JSON is laid out (llguidance's x-guidance options).
JSON_DEFAULTS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_NAMES = {"json": "JSON schema", "json_object": "JSON object", "regex": "regex",
          "choice": "choice", "grammar": "grammar"}


class LLGuidanceGrammar(Grammar):
    """An ``llguidance.LLMatcher`` over one grammar (serialized, so fresh copies are cheap)."""

    def __init__(self, backend: LLGuidanceBackend, grammar: str) -> None:
        self.backend = backend
        self.grammar = grammar
        self.matcher = llguidance.LLMatcher(backend.ll_tokenizer, grammar, log_level=0)
        self.num_accepted = 0
        self.terminated = False

    def accept_token(self, token_id: int) -> bool:
        token_id = int(token_id)
        if self.terminated or not 0 <= token_id < self.backend.vocab_size:
            return False
        m = self.matcher
        if token_id in self.backend.eos_token_ids:
            # The end: allowed once the text is a complete match (the matcher may already
            # have stopped, when nothing can follow).
            if not (m.is_stopped() or m.is_accepting()) or not m.consume_token(token_id):
                return False
            self.terminated = True
        elif m.validate_tokens([token_id]) != 1 or not m.consume_token(token_id):
            return False  # (consuming a bad token would leave the matcher in error)
        self.num_accepted += 1
        return True

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        llguidance.torch.fill_next_token_bitmask(self.matcher, bitmask, row)
        bitmask[row, self.backend.hidden_words] &= self.backend.hidden_masks

    def is_terminated(self) -> bool:
        return self.terminated

    def rollback(self, num_tokens: int) -> None:
        if not 0 <= num_tokens <= self.num_accepted:
            raise ValueError(f"cannot roll back {num_tokens} tokens: {self.num_accepted} "
                             "were accepted")
        if num_tokens:
            self.matcher.rollback(num_tokens)
            self.num_accepted -= num_tokens
            self.terminated = False

    def reset(self) -> None:
        self.matcher.reset()
        self.num_accepted = 0
        self.terminated = False

    def fresh(self) -> LLGuidanceGrammar:
        return LLGuidanceGrammar(self.backend, self.grammar)


class LLGuidanceBackend(StructuredOutputBackend):
    """The structured-output contract on llguidance (see the module docstring)."""

    contract_version = 2

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be positive, got {vocab_size}")
        self.vocab_size = vocab_size
        self.eos_token_ids = frozenset(tokenizer.eos_token_ids)
        # llguidance.torch (the bitmask functions) imports torch.compile's machinery, seconds
        # of start-up: imported here, where the engine makes the backend (off its loop, for
        # the first request that needs one), not when the plugin registers.
        import llguidance.torch  # noqa: F401
        self.ll_tokenizer = llguidance.hf.from_tokenizer(
            tokenizer.hf, n_vocab=vocab_size, eos_token=sorted(self.eos_token_ids) or None)
        # Special tokens other than EOS (<|im_start|> and the like) are never allowed, as with
        # xgrammar: their bits are cleared after each fill.
        hidden = sorted(set(getattr(tokenizer.hf, "all_special_ids", ()))
                        - self.eos_token_ids)
        hidden = [t for t in hidden if t < vocab_size]
        words: dict[int, int] = {}
        for t in hidden:
            words[t // 32] = words.get(t // 32, 0) | (1 << (t % 32))
        self.hidden_words = torch.tensor(sorted(words), dtype=torch.long)
        self.hidden_masks = torch.tensor([_int32(~words[w]) for w in sorted(words)],
                                         dtype=torch.int32)
        self._executor = llguidance.LLExecutor(max(1, min(8, (os.cpu_count() or 2) // 2)))

    def compile_grammar(self, kind: str, spec: Any) -> LLGuidanceGrammar:
        grammar = self.serialize(kind, spec)
        error = llguidance.LLMatcher.validate_grammar(grammar, self.ll_tokenizer)
        if error:
            raise ValueError(f"invalid {_NAMES.get(kind, kind)}: {error.strip()}")
        return LLGuidanceGrammar(self, grammar)

    @staticmethod
    def serialize(kind: str, spec: Any) -> str:
        """llguidance's grammar text for one constraint (ValueError if it cannot be read)."""
        if kind == "json":
            if isinstance(spec, str):
                try:
                    spec = json.loads(spec)
                except ValueError as e:
                    raise ValueError(f"invalid JSON schema: Failed to parse JSON: {e}") from None
            return llguidance.LLMatcher.grammar_from_json_schema(strict(spec),
                                                                 defaults=JSON_DEFAULTS)
        if kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"},
                                                                 defaults=JSON_DEFAULTS)
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(spec)
        if kind == "choice":
            if not spec:
                raise ValueError("choice needs at least one string")
            # Each choice as a JSON-quoted Lark literal: JSON escapes are Lark's.
            alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in spec)
            return llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}")
        if kind == "grammar":
            try:
                lark = any_to_lark(spec)  # GBNF ("::=") to Lark; Lark passes through
            except Exception as e:
                raise ValueError(f"invalid grammar: {e}") from None
            return llguidance.LLMatcher.grammar_from_lark(lark)
        raise ValueError(f"unknown structured output kind {kind!r}")

    def allocate_bitmask(self, num_rows: int) -> torch.Tensor:
        return llguidance.torch.allocate_token_bitmask(num_rows, self.vocab_size)

    def fill_bitmasks(self, grammars: list[Grammar | None], bitmask: torch.Tensor) -> None:
        pairs = []
        for row, grammar in enumerate(grammars):
            if grammar is None or grammar.is_terminated():
                continue
            if not isinstance(grammar, LLGuidanceGrammar):
                super().fill_bitmasks(grammars, bitmask)
                return
            pairs.append((grammar.matcher, row))
        if len(pairs) > 1:  # on llguidance's threads, without the GIL
            llguidance.torch.fill_next_token_bitmask_par(self._executor, pairs, bitmask)
            rows = torch.tensor([row for _, row in pairs])
            sub = bitmask[rows[:, None], self.hidden_words[None, :]]
            bitmask[rows[:, None], self.hidden_words[None, :]] = sub & self.hidden_masks
        elif pairs:
            grammars[pairs[0][1]].fill_bitmask(bitmask, pairs[0][1])

    def apply_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor,
                      rows: list[int] | None = None) -> None:
        """``-inf`` where the bitmask says no, for ``rows`` (all if None), on any device."""
        index = None if rows is None else torch.tensor(rows, device=logits.device)
        mask = bitmask if rows is None else bitmask[rows]
        mask = mask.to(logits.device, non_blocking=True)
        target = logits if index is None else logits[index]
        bits = torch.arange(32, device=logits.device, dtype=torch.int32)
        allowed = ((mask.unsqueeze(-1) >> bits) & 1).flatten(1)[:, :logits.shape[1]].bool()
        if allowed.shape[1] < logits.shape[1]:
            allowed = torch.nn.functional.pad(allowed, (0, logits.shape[1] - allowed.shape[1]))
        target = target.masked_fill(~allowed, float("-inf"))
        if index is None:
            logits.copy_(target)
        else:
            logits[index] = target


def strict(schema: Any) -> Any:
    """The schema with ``additionalProperties: false`` on every object schema that does not
    say (xgrammar's strict mode, and vLLM's ``disable-additional-properties`` for guidance):
    the output has the properties the schema names, not invented ones."""
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict(v) if k not in ("enum", "const", "default", "examples") else v
           for k, v in schema.items()}
    if ("properties" in out or out.get("type") == "object") \
            and "additionalProperties" not in out and "patternProperties" not in out:
        out["additionalProperties"] = False
    return out


def _int32(value: int) -> int:
    """``value`` as a signed 32-bit integer (the bitmask's element type)."""
    value &= 0xFFFFFFFF
    return value - (1 << 32) if value >= 1 << 31 else value
