"""Reasoning parsers fed token by token, the way a stream reaches them: prompts rendered by
Qwen3- and DeepSeek-R1-style chat templates (tests/templates), outputs tokenized by a real
tokenizer (the embedded SmolLM2's, where ``</think>`` takes several tokens, and the same with
the tags added as single tokens, as Qwen3's and R1's vocabularies hold them). Whatever the
pieces, the stream equals the whole parse; a tag split across tokens is held back; an
unclosed reasoning (max_tokens) stays reasoning; thinking turned off is all content. Then the
gate that starts a structured output after the reasoning and forces the end tag at a
thinking budget, and the plugin registry."""

from __future__ import annotations

import types
from functools import cache

import pytest
import torch
import transformers

from asyncengine.engine.reasoning_gate import ReasoningGate
from asyncengine.ext.registry import new_plugin_manager, registered, resolve_reasoning_parser
from asyncengine.plugins import hookimpl
from asyncengine.text.reasoning_parsers import (
    DeepSeekR1ReasoningParser,
    Qwen3ReasoningParser,
    ReasoningDelta,
    ReasoningParser,
)
from tests.server_utils import TEMPLATES
from tests.utils import embedded_tokenizer_dir

ASK = [{"role": "user", "content": "What is 2 + 2?"}]
HISTORY = [*ASK, {"role": "assistant", "content": "<think>\nEasy.\n</think>\n\n4."},
           {"role": "user", "content": "And 3 + 3?"}]


@cache
def tokenizer(tags_as_tokens: bool):
    tok = transformers.AutoTokenizer.from_pretrained(str(embedded_tokenizer_dir()))
    if tags_as_tokens:
        tok.add_tokens(["<think>", "</think>"])
    return tok


def render(template: str, messages, **kwargs) -> str:
    if template == "deepseek_r1.jinja":
        kwargs.setdefault("thinking", True)
    source = (TEMPLATES / template).read_text()
    return tokenizer(False).apply_chat_template(messages, chat_template=source, tokenize=False,
                                                add_generation_prompt=True, **kwargs)


def token_pieces(text: str, tags_as_tokens: bool) -> tuple[list[int], list[str]]:
    """The output's token ids and the text each token adds (as the detokenizer streams it)."""
    tok = tokenizer(tags_as_tokens)
    ids = tok.encode(text, add_special_tokens=False)
    pieces, before = [], ""
    for i in range(len(ids)):
        now = tok.decode(ids[:i + 1])
        pieces.append(now[len(before):])
        before = now
    assert "".join(pieces) == text
    return ids, pieces


def stream(parser: ReasoningParser, pieces: list[str]) -> ReasoningDelta:
    out = ReasoningDelta()
    for piece in pieces:
        out.extend(parser.feed(piece))
    out.extend(parser.finish())
    return out


def check(cls: type[ReasoningParser], prompt: str, output: str, reasoning: str | None,
          content: str | None) -> None:
    whole = cls(prompt).parse(output)
    assert (whole.reasoning, whole.content) == (reasoning, content)
    for tags_as_tokens in (False, True):
        _, pieces = token_pieces(output, tags_as_tokens)
        got = stream(cls(prompt), pieces)
        assert (got.reasoning or None, got.content or None) == (reasoning, content)
    for size in (1, 2, 3, 5):  # every split of a tag, by characters
        got = stream(cls(prompt), [output[i:i + size] for i in range(0, len(output), size)])
        assert (got.reasoning or None, got.content or None) == (reasoning, content)


def test_templates_open_and_close_the_think_block_as_the_models_do():
    r1 = render("deepseek_r1.jinja", HISTORY)
    assert r1.endswith("<｜Assistant｜><think>\n") and "Easy." not in r1
    assert DeepSeekR1ReasoningParser.initial_state(r1) == "reasoning"
    assert render("deepseek_r1.jinja", ASK, thinking=False).endswith("<｜Assistant｜></think>")
    qwen = render("qwen3_think.jinja", HISTORY)
    assert qwen.endswith("<|im_start|>assistant\n") and "Easy." not in qwen
    assert Qwen3ReasoningParser.initial_state(qwen) == "before"
    off = render("qwen3_think.jinja", ASK, enable_thinking=False)
    assert off.endswith("<think>\n\n</think>\n\n")
    assert Qwen3ReasoningParser.initial_state(off) == "answer"


def test_qwen3_splits_the_think_block_token_by_token():
    prompt = render("qwen3_think.jinja", ASK)
    check(Qwen3ReasoningParser, prompt, "<think>\nTwo and two: 4 </thin no.\n</think>\n\n4.",
          "\nTwo and two: 4 </thin no.\n", "\n\n4.")


def test_qwen3_without_a_think_block_is_all_content():
    prompt = render("qwen3_think.jinja", ASK)
    check(Qwen3ReasoningParser, prompt, "It is 4 <thi", None, "It is 4 <thi")


def test_qwen3_with_thinking_off_is_all_content_even_with_tags():
    prompt = render("qwen3_think.jinja", ASK, enable_thinking=False)
    check(Qwen3ReasoningParser, prompt, "4. <think>x</think> y", None,
          "4. <think>x</think> y")


def test_qwen3_unclosed_think_block_is_reasoning_at_max_tokens():
    prompt = render("qwen3_think.jinja", ASK)
    check(Qwen3ReasoningParser, prompt, "<think>\nStill thinking </thi", "\nStill thinking </thi",
          None)


def test_deepseek_r1_reasoning_needs_no_start_tag():
    prompt = render("deepseek_r1.jinja", HISTORY)
    check(DeepSeekR1ReasoningParser, prompt, "Three and three.\n</think>\n\n6.",
          "Three and three.\n", "\n\n6.")
    # A model that writes the start tag anyway (older templates): it is dropped.
    check(DeepSeekR1ReasoningParser, "<｜Assistant｜>", "<think>\nHm.\n</think>6.", "\nHm.\n",
          "6.")


def test_deepseek_r1_unclosed_reasoning_is_all_reasoning():
    prompt = render("deepseek_r1.jinja", ASK)
    check(DeepSeekR1ReasoningParser, prompt, "Let me see, 2 + 2 </th", "Let me see, 2 + 2 </th",
          None)


def test_a_split_end_tag_is_held_back_until_known():
    parser = DeepSeekR1ReasoningParser(render("deepseek_r1.jinja", ASK))
    assert parser.feed("Four.\n</th") == ReasoningDelta(reasoning="Four.\n")
    assert parser.feed("ink>") == ReasoningDelta()
    assert parser.ended
    assert parser.feed("\n4") == ReasoningDelta(content="\n4")


@pytest.mark.parametrize("tags_as_tokens", [False, True])
def test_reasoning_tokens_counted_between_the_tags(tags_as_tokens):
    tok = tokenizer(tags_as_tokens)
    start = tok.encode("<think>", add_special_tokens=False)
    end = tok.encode("</think>", add_special_tokens=False)
    thought = tok.encode("\nTwo and two.\n", add_special_tokens=False)
    answer = tok.encode("\n\n4.", add_special_tokens=False)
    qwen = render("qwen3_think.jinja", ASK)
    assert Qwen3ReasoningParser.count_reasoning_tokens(
        qwen, start + thought + end + answer, start, end) == len(thought)
    assert Qwen3ReasoningParser.count_reasoning_tokens(qwen, answer, start, end) == 0
    r1 = render("deepseek_r1.jinja", ASK)
    assert DeepSeekR1ReasoningParser.count_reasoning_tokens(
        r1, thought + end + answer, start, end) == len(thought)
    assert DeepSeekR1ReasoningParser.count_reasoning_tokens(r1, thought, start, end) == \
        len(thought)  # unclosed
    off = render("qwen3_think.jinja", ASK, enable_thinking=False)
    assert Qwen3ReasoningParser.count_reasoning_tokens(off, start + thought + end, start,
                                                       end) == 0


# -- the gate: structured outputs after the reasoning, the thinking budget ----------------------
class Digits:
    """A stand-in grammar: only tokens < 10 allowed; terminates on token 0."""

    def __init__(self) -> None:
        self.accepted: list[int] = []

    def accept_token(self, t: int) -> bool:
        if t >= 10 or self.is_terminated():
            return False
        self.accepted.append(t)
        return True

    def fill_bitmask(self, bitmask, row) -> None:
        bitmask[row].fill_(0)
        bitmask[row, 0] = (1 << 10) - 1

    def is_terminated(self) -> bool:
        return bool(self.accepted) and self.accepted[-1] == 0

    def rollback(self, n: int) -> None:
        del self.accepted[len(self.accepted) - n:]

    def reset(self) -> None:
        self.accepted.clear()

    def fresh(self):
        return Digits()


def allowed(gate: ReasoningGate, vocab: int = 100) -> list[int]:
    mask = torch.full((1, (vocab + 31) // 32), -1, dtype=torch.int32)
    gate.fill_bitmask(mask, 0)
    return [t for t in range(vocab) if (int(mask[0, t // 32]) >> (t % 32)) & 1]


def test_the_gate_constrains_only_what_follows_the_end_tag():
    inner = Digits()
    gate = ReasoningGate(inner, [50, 51])
    for t in (70, 50, 80, 50):  # reasoning, a false start of the tag
        assert allowed(gate) == list(range(100))
        assert gate.accept_token(t)
    assert gate.accept_token(51) and not gate.reasoning and gate.num_reasoning == 3
    assert allowed(gate) == list(range(10))
    assert not gate.accept_token(70)
    assert gate.accept_token(3) and gate.accept_token(0) and gate.is_terminated()
    assert inner.accepted == [3, 0]
    gate.rollback(3)  # back into the reasoning
    assert gate.reasoning and inner.accepted == [] and gate.num_reasoning == 3


def test_the_budget_forces_the_end_tag_token_by_token():
    gate = ReasoningGate(None, [50, 51, 52], budget=2)
    assert gate.accept_token(7) and allowed(gate) == list(range(100))
    assert gate.accept_token(8)
    assert allowed(gate) == [50]
    assert not gate.accept_token(9)
    assert gate.accept_token(50) and allowed(gate) == [51]
    assert gate.accept_token(51) and allowed(gate) == [52]
    assert gate.accept_token(52) and not gate.reasoning
    assert allowed(gate) == list(range(100)) and not gate.is_terminated()
    zero = ReasoningGate(None, [95], budget=0)  # token 95: the sign bit of its word
    assert allowed(zero) == [95]


# -- the registry ------------------------------------------------------------------------------
class Bracketed(ReasoningParser):
    name = "bracketed"
    start_tag, end_tag = "[[", "]]"


def test_builtins_registered_and_a_plugin_adds_one():
    assert {"deepseek_r1", "qwen3"} <= set(registered("reasoning_parsers"))
    assert resolve_reasoning_parser("qwen3") is Qwen3ReasoningParser
    with pytest.raises(ValueError, match="--reasoning-parser: reasoning parser 'nope'"):
        resolve_reasoning_parser("nope")
    plugin = types.SimpleNamespace(register_reasoning_parsers=hookimpl(
        lambda register: register("bracketed", Bracketed)))
    pm = new_plugin_manager(load_entrypoints=False)
    pm.register(plugin, name="brackets")
    cls = resolve_reasoning_parser("bracketed", pm)
    assert cls("").parse("[[hm]]ok").reasoning == "hm"



def test_tool_calls_are_read_from_the_answer_only():
    """The chat server's chain: the reasoning parser first, the tool parser on its content."""
    from asyncengine.text.tool_parsers import HermesToolParser

    call = '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
    output = f"I could write {call} here.\n</think>\n\n{call}"
    prompt = render("deepseek_r1.jinja", ASK)
    _, pieces = token_pieces(output, True)
    thinker, tools = DeepSeekR1ReasoningParser(prompt), HermesToolParser()
    reasoning = ""
    calls = []
    for piece in [*pieces, None]:
        split = thinker.feed(piece) if piece is not None else thinker.finish()
        reasoning += split.reasoning
        parsed = tools.feed(split.content)
        calls += [c.name for c in parsed.calls if c.name]
    assert reasoning == f"I could write {call} here.\n"
    assert calls == ["f"]  # one call: the answer's, not the one inside the thinking
