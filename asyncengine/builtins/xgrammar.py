"""The default structured-output backend: xgrammar (pushdown automata over the vocabulary).

Facts this relies on (xgrammar >= 0.2): a ``GrammarMatcher`` allows only the stop tokens once
its grammar is complete and cannot continue, and terminates when it accepts one; we make the
engine's EOS tokens the stop tokens, so a finished structure ends the request with EOS
(finish reason "stop"). Token ids whose vocabulary entry is empty are never allowed; we blank
the tokenizer's special tokens other than EOS (``<|im_start|>`` and the like), which a
detokenizer would drop, and the ids past the tokenizer's vocabulary (model padding).
"""

from __future__ import annotations

import json
import os
import re
from typing import TYPE_CHECKING, Any

import torch
import xgrammar as xgr

from asyncengine.plugins import Grammar, StructuredOutputBackend

if TYPE_CHECKING:
    from asyncengine.plugins import Tokenizer

# xgrammar's C++ errors start with "[hh:mm:ss] /path/file.cc:123: " and sometimes a failed
# check's text; neither means anything to a user.
_NOISE = re.compile(r"\[[\d:]+\] \S+:\d+: |Check failed: .*? is false: ")


def _clean(message: str) -> str:
    return _NOISE.sub("", message).strip()


class XGrammarGrammar(Grammar):
    """An ``xgr.GrammarMatcher`` over one compiled grammar."""

    def __init__(self, compiled: xgr.CompiledGrammar) -> None:
        self.compiled = compiled
        self.matcher = xgr.GrammarMatcher(compiled)
        self.num_accepted = 0

    def accept_token(self, token_id: int) -> bool:
        if not self.matcher.accept_token(int(token_id)):
            return False
        self.num_accepted += 1
        return True

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()

    def rollback(self, num_tokens: int) -> None:
        if not 0 <= num_tokens <= self.num_accepted:
            raise ValueError(f"cannot roll back {num_tokens} tokens: {self.num_accepted} "
                             "were accepted")
        if num_tokens:
            self.matcher.rollback(num_tokens)
            self.num_accepted -= num_tokens

    def reset(self) -> None:
        self.matcher.reset()
        self.num_accepted = 0

    def fresh(self) -> XGrammarGrammar:
        return XGrammarGrammar(self.compiled)


class XGrammarBackend(StructuredOutputBackend):
    """JSON schemas, any JSON object, regexes, choices and EBNF (GBNF) or Lark grammars.

    JSON is generated compactly (no free whitespace between tokens: ``{"a": 1, "b": [2]}``):
    a small model allowed arbitrary whitespace can loop on newlines until max_tokens.
    """

    #: Allow arbitrary whitespace between JSON tokens.
    any_whitespace = False
    #: Memory bound for xgrammar's own compilation cache (the manager caches too).
    cache_limit_bytes = 512 * 2**20

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be positive, got {vocab_size}")
        self.vocab_size = vocab_size
        self.tokenizer_info = _tokenizer_info(tokenizer, vocab_size)
        self.compiler = xgr.GrammarCompiler(
            self.tokenizer_info, max_threads=min(8, os.cpu_count() or 1),
            cache_limit_bytes=self.cache_limit_bytes)
        self._apply_backend = "auto"
        self._batch_matcher = xgr.BatchGrammarMatcher()

    def compile_grammar(self, kind: str, spec: Any) -> XGrammarGrammar:
        try:
            compiled = self._compile(kind, spec)
        except (RuntimeError, TypeError, UnicodeError) as e:  # (xgrammar reads text as UTF-8
            # bytes: a grammar that splits a character fails to decode)
            raise ValueError(f"invalid {_NAMES.get(kind, kind)}: {_clean(str(e))}") from None
        return XGrammarGrammar(compiled)

    def _compile(self, kind: str, spec: Any) -> xgr.CompiledGrammar:
        c = self.compiler
        if kind == "json":
            schema = spec if isinstance(spec, str) else json.dumps(spec)
            return c.compile_json_schema(schema, any_whitespace=self.any_whitespace)
        if kind == "json_object":
            return c.compile_json_schema('{"type": "object"}', any_whitespace=self.any_whitespace,
                                         strict_mode=False)
        if kind == "regex":
            return c.compile_regex(spec)
        if kind == "choice":
            return c.compile_grammar(choice_ebnf(spec))
        if kind == "grammar":
            # GBNF / xgrammar EBNF defines rules with "::="; otherwise read it as Lark.
            return c.compile_grammar(spec) if "::=" in spec else c.compile_lark(spec)
        raise ValueError(f"unknown structured output kind {kind!r}")

    def fill_bitmasks(self, grammars: list[Grammar | None], bitmask: torch.Tensor) -> None:
        rows: list[int] = []
        matchers: list[xgr.GrammarMatcher] = []
        for row, grammar in enumerate(grammars):
            if grammar is None or grammar.is_terminated():
                continue
            unwrap = getattr(grammar, "unwrap", None)  # a reasoning model's gate
            if unwrap is not None:
                inner = unwrap()
                if inner is None:  # still reasoning: the row stays open, or forces its tag
                    grammar.fill_bitmask(bitmask, row)
                    continue
                grammar = inner
            if not isinstance(grammar, XGrammarGrammar):
                super().fill_bitmasks(grammars, bitmask)
                return
            rows.append(row)
            matchers.append(grammar.matcher)
        if len(rows) == 1:
            matchers[0].fill_next_token_bitmask(bitmask, rows[0])
        elif rows:
            # Some states (inside a bounded string...) take milliseconds: fill the rows on
            # xgrammar's thread pool (half the cores), with the GIL released.
            self._batch_matcher.batch_fill_next_token_bitmask(matchers, bitmask, rows)

    def allocate_bitmask(self, num_rows: int) -> torch.Tensor:
        return xgr.allocate_token_bitmask(num_rows, self.vocab_size)

    def apply_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor,
                      rows: list[int] | None = None) -> None:
        if bitmask.device != logits.device:
            bitmask = bitmask.to(logits.device, non_blocking=True)
        try:
            xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=self.vocab_size,
                                            indices=rows, backend=self._apply_backend)
        except ImportError:  # no triton on this CUDA machine: xgrammar's plain-torch kernel
            if self._apply_backend == "torch_native":
                raise
            self._apply_backend = "torch_native"
            self.apply_bitmask(logits, bitmask, rows)


_NAMES = {"json": "JSON schema", "json_object": "JSON object", "regex": "regex",
          "choice": "choice", "grammar": "grammar"}


def choice_ebnf(choices: list[str]) -> str:
    """An EBNF grammar matching exactly one of ``choices``. JSON string escapes are valid
    EBNF literal escapes, so ``json.dumps`` quotes each choice safely."""
    if not choices:
        raise ValueError("choice needs at least one string")
    alternatives = [json.dumps(c, ensure_ascii=False) if c else '""' for c in choices]
    return "root ::= " + " | ".join(alternatives)


def _tokenizer_info(tokenizer: Tokenizer, vocab_size: int) -> xgr.TokenizerInfo:
    hf = tokenizer.hf
    stop = sorted(tokenizer.eos_token_ids) or None
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size, stop_token_ids=stop)
    hidden = set(getattr(hf, "all_special_ids", ())) - set(stop or ())
    if not hidden:
        return info
    # Rebuild with the special tokens blanked (xgrammar never allows an empty token).
    vocab = [""] * vocab_size
    for token, idx in hf.get_vocab().items():
        if idx < vocab_size and idx not in hidden:
            vocab[idx] = token
    return xgr.TokenizerInfo(vocab, info.vocab_type, vocab_size=vocab_size, stop_token_ids=stop,
                             add_prefix_space=info.add_prefix_space)
