"""Structured outputs end to end on the embedded SmolLM2-135M-Instruct, through the offline API.

Everything constrained runs in ONE generate call (continuous batching mixes all kinds, free
requests included), checked by the tests below; one more call runs the free requests alone.
"""

from __future__ import annotations

import json
import math
import re

import anyio
import jsonschema
import pytest

from asyncengine import LLM, SamplingParams
from asyncengine.core.sampling_params import StructuredOutputsParams as SO
from tests.structured_output_schemas import SCHEMAS

REGEXES = [r"\d{3}-\d{4}", r"(yes|no), because [a-z ]{5,40}\.",
           r"[A-Z][a-z]{1,12} [A-Z][a-z]{1,12}",
           r"(25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)(\.(25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)){3}"]
CHOICES = [["positive", "negative", "neutral"], ["C++", "C#", 'Rust "2021"', "back\\slash"]]
ARITHMETIC = """
root ::= expr
expr ::= term (("+" | "-") term)*
term ::= factor (("*" | "/") factor)*
factor ::= num | "(" expr ")"
num ::= [1-9] [0-9]? [0-9]?
"""
ARITHMETIC_LARK = r"""
start: expr
expr: term (("+" | "-") term)*
term: NUMBER | "(" expr ")"
NUMBER: /[1-9][0-9]{0,2}/
"""
PERSON = SCHEMAS[0][1]
FREE = ["The capital of France is", "def fibonacci(n):", "Once upon a time,", "1, 2, 3, 4,"]


def parses_arithmetic(text: str, *, ops: str = "+-*/") -> bool:
    """A recursive-descent recognizer for ARITHMETIC (and, with ops='+-', ARITHMETIC_LARK)."""
    pos = 0

    def number() -> bool:
        nonlocal pos
        m = re.compile(r"[1-9][0-9]{0,2}").match(text, pos)
        if m:
            pos = m.end()
        return bool(m)

    def factor() -> bool:
        nonlocal pos
        if text.startswith("(", pos):
            pos += 1
            if not expr() or not text.startswith(")", pos):
                return False
            pos += 1
            return True
        return number()

    def chain(item, signs: str) -> bool:
        nonlocal pos
        if not item():
            return False
        while pos < len(text) and text[pos] in signs:
            pos += 1
            if not item():
                return False
        return True

    def term() -> bool:
        return chain(factor, "*/" if "*" in ops else "")

    def expr() -> bool:
        return chain(term, "+-")

    return expr() and pos == len(text)


def _backends() -> list:
    """xgrammar (built in) and llguidance (plugins/llguidance, installed by make install):
    every test below runs on both."""
    import importlib.util

    missing = importlib.util.find_spec("asyncengine_llguidance") is None
    return ["xgrammar", pytest.param("llguidance", marks=pytest.mark.skipif(
        missing, reason="the asyncengine-llguidance distribution is not installed"))]


@pytest.fixture(scope="module", params=_backends())
def llm(request):
    return LLM(model=None, structured_output_backend=request.param)


def chat(llm: LLM, text: str) -> str:
    return llm.tokenizer.apply_chat_template([{"role": "user", "content": text}])


@pytest.fixture(scope="module")
def batch(llm):
    """name -> (params, outputs) for every request of the one mixed generate call."""
    cases: dict[str, list[tuple[str, SamplingParams]]] = {"json_greedy": [], "json_sampled": []}
    for i, (what, schema) in enumerate(SCHEMAS):
        prompt = chat(llm, f"Reply with {what} as JSON.")
        cases["json_greedy"].append((prompt, SamplingParams(
            temperature=0, max_tokens=200, structured_outputs=SO(json=schema))))
        cases["json_sampled"].append((prompt, SamplingParams(
            temperature=1.0, seed=i, max_tokens=200, structured_outputs=SO(json=schema))))
    cases["regex"] = [(chat(llm, "Answer in the requested format."),
                       SamplingParams(temperature=0, max_tokens=64, structured_outputs=SO(regex=r)))
                      for r in REGEXES]
    cases["choice"] = [(chat(llm, f"Pick one of: {', '.join(c)}."),
                        SamplingParams(temperature=t, seed=3, max_tokens=16,
                                       structured_outputs=SO(choice=c)))
                       for c in CHOICES for t in (0.0, 1.0)]
    cases["ebnf"] = [(chat(llm, "Write an arithmetic expression."),
                      SamplingParams(temperature=t, seed=5, max_tokens=64,
                                     structured_outputs=SO(grammar=ARITHMETIC)))
                     for t in (0.0, 1.0)]
    cases["lark"] = [(chat(llm, "Write a sum of numbers."), SamplingParams(
        temperature=0, max_tokens=64, structured_outputs=SO(grammar=ARITHMETIC_LARK)))]
    prompt = chat(llm, "Reply with a person as JSON.")
    cases["n3"] = [(prompt, SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=200,
                                           structured_outputs=SO(json=PERSON)))]
    cases["cut"] = [(prompt, SamplingParams(temperature=0, max_tokens=5,
                                            structured_outputs=SO(json=PERSON)))]
    cases["logprobs"] = [(prompt, SamplingParams(temperature=0, max_tokens=200, logprobs=2,
                                                 structured_outputs=SO(json=PERSON)))]
    cases["json_object"] = [(chat(llm, "Describe your favourite food as a JSON object."),
                             SamplingParams(temperature=0, max_tokens=200,
                                            structured_outputs=SO(json_object=True)))]
    cases["stop"] = [(chat(llm, "Pick a fruit."), SamplingParams(
        temperature=0, max_tokens=16, stop=[" "],
        structured_outputs=SO(choice=["red apple", "green pear"])))]
    cases["free"] = [(p, SamplingParams(temperature=0, max_tokens=24)) for p in FREE]
    flat = [(name, p, sp) for name, items in cases.items() for p, sp in items]
    outputs = llm.generate([p for _, p, _ in flat], [sp for _, _, sp in flat])
    result: dict[str, list] = {name: [] for name in cases}
    for (name, _, sp), out in zip(flat, outputs, strict=True):
        result[name].append((sp, out))
    return result


def completions(batch, name):
    return [(sp, c) for sp, out in batch[name] for c in out.outputs]


@pytest.mark.parametrize("name", ["json_greedy", "json_sampled"])
def test_json_schema_outputs_validate(batch, llm, name):
    assert len(batch[name]) == len(SCHEMAS)
    for sp, c in completions(batch, name):
        schema = sp.structured_outputs.json
        jsonschema.validate(json.loads(c.text), schema)
        assert c.finish_reason == "stop"
        assert c.token_ids[-1] in llm.tokenizer.eos_token_ids  # the grammar ended with EOS


def test_json_object(batch):
    (sp, c), = completions(batch, "json_object")
    assert isinstance(json.loads(c.text), dict) and c.finish_reason == "stop"


def test_regex_outputs_fully_match(batch):
    for sp, c in completions(batch, "regex"):
        assert re.fullmatch(sp.structured_outputs.regex, c.text), (sp.structured_outputs, c.text)
        assert c.finish_reason == "stop"


def test_choice_outputs_are_one_of_the_choices(batch):
    for sp, c in completions(batch, "choice"):
        assert c.text in sp.structured_outputs.choice and c.finish_reason == "stop"


def test_ebnf_and_lark_grammar_outputs_parse(batch):
    for _, c in completions(batch, "ebnf"):
        assert c.finish_reason == "stop" and parses_arithmetic(c.text), c.text
    (_, c), = completions(batch, "lark")
    assert c.finish_reason == "stop" and parses_arithmetic(c.text, ops="+-"), c.text


def test_n_samples_each_follow_the_schema(batch):
    (sp, out), = batch["n3"]
    assert [c.index for c in out.outputs] == [0, 1, 2] and out.finished
    for c in out.outputs:
        jsonschema.validate(json.loads(c.text), PERSON)
        assert c.finish_reason == "stop"


def test_max_tokens_cuts_with_length(batch):
    (sp, c), = completions(batch, "cut")
    assert c.finish_reason == "length" and len(c.token_ids) == 5
    assert c.text.startswith('{"name": "')  # a prefix of a valid document, not a document


def test_logprobs_of_constrained_tokens(batch):
    (sp, c), = completions(batch, "logprobs")
    jsonschema.validate(json.loads(c.text), PERSON)
    assert len(c.logprobs) == len(c.token_ids)
    for token, entry in zip(c.token_ids, c.logprobs, strict=True):
        assert token in entry and math.isfinite(entry[token].logprob)
        assert entry[token].logprob <= 0


def test_stop_string_ends_a_constrained_request(batch):
    (sp, c), = completions(batch, "stop")
    assert c.text in ("red", "green") and c.finish_reason == "stop" and c.stop_reason == " "


def test_free_requests_are_unaffected_by_constrained_neighbours(batch, llm):
    mixed = [c.token_ids for _, c in completions(batch, "free")]
    alone = llm.generate(FREE, SamplingParams(temperature=0, max_tokens=24))
    assert [o.outputs[0].token_ids for o in alone] == mixed


#: Each invalid spec, and what its ValueError says, whichever backend compiles it: the kind of
#: constraint, and the part at fault.
INVALID = [
    (SO(json={"type": "object", "properties": {"a": {"type": "nonsense"}}}),
     r"invalid JSON schema: .*nonsense"),
    (SO(regex="[a-z"), r"invalid regex: "),
    (SO(grammar="root ::= missing"), r"invalid grammar: .*missing"),
]


def test_invalid_spec_is_a_value_error_from_add_request(llm):
    async def main():
        async with llm.engine:
            for spec, message in INVALID:
                with pytest.raises(ValueError, match=message):
                    await llm.engine.add_request("hi", SamplingParams(structured_outputs=spec))
            assert llm.engine.stats().num_waiting == 0
            # The engine goes on serving after rejecting them.
            stream = await llm.engine.add_request("hi", SamplingParams(
                max_tokens=8, structured_outputs=SO(choice=["ok"])))
            outs = [out async for out in stream]
            assert outs[-1].outputs[0].text == "ok"

    anyio.run(main)
