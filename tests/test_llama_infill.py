"""llama-server's POST /infill (``entrypoints/http/llama_infill.py``, ``text/fim.py``): the
fill-in-the-middle prompt a code model was trained on, built from the code around the
cursor, gives the tokens /completion gives for that prompt; a model without the tokens
answers 404 and /openapi.json leaves the route out."""

from __future__ import annotations

import pytest

from asyncengine.text.fim import FimTokens, fim_prompt, fim_tokens
from tests.robust_utils import assert_idle_and_free, post, robust_server
from tests.server_utils import shared_server
from tests.utils import make_tiny_model

FIM = ["<fim_prefix>", "<fim_suffix>", "<fim_middle>"]  # StarCoder's, beside <repo_name>


def test_each_models_tokens_are_found():
    qwen = {"<|fim_prefix|>": 1, "<|fim_suffix|>": 2, "<|fim_middle|>": 3,
            "<|repo_name|>": 4, "<|file_sep|>": 5}
    assert fim_tokens(qwen) == FimTokens(1, 2, 3, 4, 5)
    assert fim_tokens({"<PRE>": 7, "<SUF>": 8, "<MID>": 9}) == FimTokens(7, 8, 9)
    deepseek = {"<｜fim▁begin｜>": 1, "<｜fim▁hole｜>": 2, "<｜fim▁end｜>": 3}
    assert fim_tokens(deepseek) == FimTokens(1, 2, 3)
    assert fim_tokens({"<fim_prefix>": 1, "<fim_suffix>": 2}) is None  # no middle
    assert fim_tokens({"a": 1}) is None
    # other files: with the repository tokens, else as text before the prefix
    enc = list  # characters as "ids"
    assert fim_prompt(FimTokens(1, 2, 3, 4, 5), enc, "p", "s", "m", [("f", "x")]) == [
        4, *"myproject\n", 5, *"f\nx", 5, 1, "p", 2, "s", 3, "m"]
    assert fim_prompt(FimTokens(1, 2, 3), enc, "p", "s", "", [("f", "x")], bos=[0]) == [
        0, "x", 1, "p", 2, "s", 3]


@pytest.fixture(scope="module")
def coder(tmp_path_factory) -> str:
    """The tiny llama with StarCoder's three fill-in-the-middle tokens added (ids 49152+)."""
    import transformers

    path = make_tiny_model(tmp_path_factory.mktemp("fim") / "coder", "llama",
                           vocab_size=49160)
    tok = transformers.AutoTokenizer.from_pretrained(path)
    tok.add_special_tokens({"additional_special_tokens": FIM})
    tok.save_pretrained(path)
    return path


def test_infill_gives_the_fim_prompts_tokens(coder):
    import transformers

    server = shared_server(coder, "--max-model-len", "256")
    tok = transformers.AutoTokenizer.from_pretrained(coder)
    pre, suf, mid = tok.convert_tokens_to_ids(FIM)
    prefix, suffix = "def add(a, b):\n    return ", "\n\nprint(add(1, 2))\n"
    sampling = {"n_predict": 6, "temperature": 0, "ignore_eos": True}

    def ids(text: str) -> list[int]:
        return tok(text, add_special_tokens=False).input_ids

    want = tok("").input_ids + [pre, *ids(prefix), suf, *ids(suffix), mid, *ids("a")]
    status, _, got = post(server, "/infill", {"input_prefix": prefix, "input_suffix": suffix,
                                              "prompt": "a", **sampling})
    assert status == 200, got
    _, _, same = post(server, "/completion", {"prompt": want, **sampling})
    assert got["content"] == same["content"] and got["tokens_evaluated"] == len(want)
    assert got["tokens_predicted"] == 6 and got["stop"] is True
    # other files come first, under StarCoder's repository tokens
    status, _, more = post(server, "/infill", {"input_prefix": prefix, "input_suffix": suffix,
                                               "input_extra": [{"filename": "util.py",
                                                                "text": "X = 1\n"}],
                                               **sampling})
    assert status == 200 and more["tokens_evaluated"] > len(want)
    assert "/infill" in server.get_json("/openapi.json")["paths"]
    assert_idle_and_free(server)


def test_a_model_without_the_tokens_has_no_infill(tiny_llama):
    server = robust_server(tiny_llama)
    status, _, err = post(server, "/infill", {"input_prefix": "def f():"})
    assert status == 404 and "fill-in-the-middle" in err["error"]["message"]
    assert "/infill" not in server.get_json("/openapi.json")["paths"]


def test_completions_suffix_inserts_on_a_code_model(coder):
    """OpenAI's ``suffix`` on /v1/completions (insertion) is the same fill-in-the-middle
    prompt: the same tokens as /infill; published in /openapi.json for such a model only."""
    server = shared_server(coder, "--max-model-len", "256")
    prefix, suffix = "def add(a, b):\n    return ", "\n\nprint(add(1, 2))\n"
    _, _, infill = post(server, "/infill", {"input_prefix": prefix, "input_suffix": suffix,
                                            "n_predict": 6, "temperature": 0,
                                            "ignore_eos": True})
    status, _, cmpl = post(server, "/v1/completions", {
        "prompt": prefix, "suffix": suffix, "max_tokens": 6, "temperature": 0,
        "ignore_eos": True})
    assert status == 200, cmpl
    assert cmpl["choices"][0]["text"] == infill["content"]
    assert cmpl["usage"]["prompt_tokens"] == infill["tokens_evaluated"]
    status, _, err = post(server, "/v1/completions", {"prompt": prefix, "suffix": suffix,
                                                      "echo": True, "max_tokens": 2})
    assert status == 400 and err["error"]["param"] == "suffix"
    doc = server.get_json("/openapi.json")["components"]["schemas"]["CompletionRequest"]
    assert {"type": "string"} in doc["properties"]["suffix"]["anyOf"]
    assert "suffix" in doc["dependentSchemas"]
    assert_idle_and_free(server)
