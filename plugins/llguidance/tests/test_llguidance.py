"""asyncengine-llguidance: --structured-output-backend llguidance end to end on the embedded
SmolLM2 (every kind of constraint in one mixed batch, each output checked as the xgrammar
engine tests check theirs; the backend-level tests of
tests/plugins/test_structured_output_backend.py run on both backends), and ``auto``: per
request, llguidance for a schema xgrammar does not enforce, xgrammar for the rest, in one
batch."""

from __future__ import annotations

import importlib.metadata
import json
import re
import sys
from pathlib import Path

import jsonschema
import pytest
import tomllib

pytest.importorskip("llguidance", reason="llguidance is not installed (pip install llguidance)")

DIST = Path(__file__).resolve().parents[1]
if str(DIST) not in sys.path:  # run from a checkout without installing the distribution
    sys.path.insert(0, str(DIST))

import asyncengine_llguidance.plugin  # noqa: E402
from asyncengine_llguidance.backend import LLGuidanceBackend, LLGuidanceGrammar  # noqa: E402

from asyncengine import LLM, SamplingParams, StructuredOutputsParams  # noqa: E402
from asyncengine.builtins.auto_structured_output import AutoBackend  # noqa: E402
from asyncengine.builtins.xgrammar import XGrammarGrammar  # noqa: E402
from asyncengine.plugins import new_plugin_manager, registered  # noqa: E402
from tests.engine.test_structured_output_engine import (  # noqa: E402
    ARITHMETIC,
    ARITHMETIC_LARK,
    CHOICES,
    REGEXES,
    parses_arithmetic,
)
from tests.structured_output_schemas import SCHEMAS  # noqa: E402

#: A regex xgrammar cannot compile (Unicode classes); llguidance can.
CAPITALIZED = r"\p{Lu}\p{Ll}{2,8}"
#: A schema keyword xgrammar does not enforce (and llguidance refuses).
UNIQUE = {"type": "array", "items": {"enum": ["a", "b"]}, "uniqueItems": True}


def plugin_manager():
    pm = new_plugin_manager(load_entrypoints=False)
    pm.register(asyncengine_llguidance.plugin, name="llguidance")
    return pm


def chat(llm: LLM, text: str) -> str:
    return llm.tokenizer.apply_chat_template([{"role": "user", "content": text}])


def SO(**kw) -> StructuredOutputsParams:
    return StructuredOutputsParams(**kw)


def test_every_kind_end_to_end():
    llm = LLM(None, structured_output_backend="llguidance", plugin_manager=plugin_manager())
    cases: list[tuple[str, str, SamplingParams]] = []
    for what, schema in SCHEMAS[:3]:
        cases.append(("json", chat(llm, f"Reply with {what} as JSON."), SamplingParams(
            temperature=0, max_tokens=100, structured_outputs=SO(json=schema))))
    cases += [("regex", chat(llm, "Answer in the requested format."), SamplingParams(
        temperature=0, max_tokens=32, structured_outputs=SO(regex=REGEXES[0])))]
    cases += [("choice", chat(llm, f"Pick one of: {', '.join(c)}."), SamplingParams(
        temperature=1.0, seed=3, max_tokens=16, structured_outputs=SO(choice=c)))
        for c in CHOICES]
    cases.append(("ebnf", chat(llm, "Write an arithmetic expression."), SamplingParams(
        temperature=0, max_tokens=32, structured_outputs=SO(grammar=ARITHMETIC))))
    cases.append(("lark", chat(llm, "Write a sum of numbers."), SamplingParams(
        temperature=0, max_tokens=32, structured_outputs=SO(grammar=ARITHMETIC_LARK))))
    cases.append(("json_object", chat(llm, "Describe a cat as a JSON object."), SamplingParams(
        temperature=0, max_tokens=80, structured_outputs=SO(json_object=True))))
    cases.append(("free", "The capital of France is", SamplingParams(temperature=0,
                                                                     max_tokens=8)))
    outs = llm.generate([p for _, p, _ in cases], [sp for _, _, sp in cases])
    for (kind, _, sp), out in zip(cases, outs, strict=True):
        c = out.outputs[0]
        so = sp.structured_outputs
        if kind != "free":
            assert c.finish_reason == "stop", (kind, c.text)
            assert c.token_ids[-1] in llm.tokenizer.eos_token_ids
        if kind == "json":
            jsonschema.validate(json.loads(c.text), so.json)
        elif kind == "regex":
            assert re.fullmatch(so.regex, c.text), (so.regex, c.text)
        elif kind == "choice":
            assert c.text in so.choice
        elif kind in ("ebnf", "lark"):
            assert parses_arithmetic(c.text, ops="+-*/" if kind == "ebnf" else "+-"), c.text
        elif kind == "json_object":
            assert isinstance(json.loads(c.text), dict)
    assert llm.engine.num_free_blocks == llm.engine.num_total_blocks


def test_auto_sends_what_xgrammar_cannot_do_to_llguidance():
    llm = LLM(None, structured_output_backend="auto", plugin_manager=plugin_manager())
    auto = AutoBackend.for_plugin_manager(plugin_manager())(llm.tokenizer,
                                                             llm.engine.vocab_size)
    person = SCHEMAS[0][1]
    assert isinstance(auto.compile_grammar("json", person), XGrammarGrammar)
    assert isinstance(auto.compile_grammar("regex", r"\d+"), XGrammarGrammar)
    with pytest.raises(ValueError, match="Unicode character class"):
        auto.primary.compile_grammar("regex", CAPITALIZED)
    assert isinstance(auto.compile_grammar("regex", CAPITALIZED), LLGuidanceGrammar)
    # A keyword xgrammar would not enforce is refused, not served unenforced.
    with pytest.raises(ValueError, match="xgrammar does not enforce uniqueItems, and "
                       "llguidance refuses it"):
        auto.compile_grammar("json", UNIQUE)
    # Without llguidance, auto is xgrammar, and says what to install.
    alone = AutoBackend.for_plugin_manager(new_plugin_manager(load_entrypoints=False))(
        llm.tokenizer, llm.engine.vocab_size)
    with pytest.raises(ValueError, match="Unicode character class"):
        alone.compile_grammar("regex", CAPITALIZED)
    with pytest.raises(ValueError, match="install the llguidance backend"):
        alone.compile_grammar("json", UNIQUE)

    # One batch, both backends' grammars in one bitmask.
    prompt = chat(llm, "Reply with a name.")
    outs = llm.generate([prompt, prompt], [
        SamplingParams(temperature=0, max_tokens=60, structured_outputs=SO(json=person)),
        SamplingParams(temperature=1.0, seed=1, max_tokens=12,
                       structured_outputs=SO(regex=CAPITALIZED))])
    assert all(out.outputs[0].finish_reason == "stop" for out in outs)
    jsonschema.validate(json.loads(outs[0].outputs[0].text), person)
    name = outs[1].outputs[0].text
    assert 3 <= len(name) <= 9 and name[0].isupper() and name[1:].islower(), name
    assert llm.engine.num_free_blocks == llm.engine.num_total_blocks


def test_the_declared_entry_point_registers_llguidance():
    project = tomllib.loads((DIST / "pyproject.toml").read_text())
    value = project["project"]["entry-points"]["asyncengine"]["llguidance"]
    pm = new_plugin_manager(load_entrypoints=False)
    pm.register(importlib.metadata.EntryPoint("llguidance", value, "asyncengine").load(),
                name="llguidance")
    assert registered("structured_output_backends", pm)["llguidance"] is LLGuidanceBackend
    installed = {e.name: e.value for e in importlib.metadata.entry_points(group="asyncengine")}
    if "llguidance" in installed:  # `make install` installs it (editable)
        assert installed["llguidance"] == value
