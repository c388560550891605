"""llama-server's POST /infill (``entrypoints/http/llama_server/infill.py``, ``text/fim.py``): the
fill-in-the-middle prompt a code model was trained on, built from the code around the
cursor, gives the tokens /completion gives for that prompt; a model without the tokens
answers 404 and /openapi.json leaves the route out."""

from __future__ import annotations

import pytest

from asyncengine.text.fim import SNIPPET, FimTokens, fim_prompt, fim_tokens, infill_prompt
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


def test_infill_prompts_are_llama_servers():
    """Other files first (the repository pattern, or snippet lines without its tokens), then
    BOS, then PRE prefix prompt SUF suffix MID; fitted as llama-server fits them: the prefix's
    last 3/4 of the batch, the suffix's first 1/4 less the prompt and two, the other files'
    last n_ctx - n_batch - 2 n_predict tokens."""
    enc = list  # characters as "ids"
    qwen, plain = FimTokens(1, 2, 3, 4, 5), FimTokens(1, 2, 3)
    big = dict(n_batch=100, n_ctx=1000, n_predict=10)
    assert infill_prompt(qwen, enc, "pre", "suf", "ty", [("a.py", "x")], [0], **big) == [
        4, *"myproject\n", 5, *"a.py\n", "x", 5, *"filename\n", 0,
        1, *"pre", *"ty", 2, *"suf", 3]
    assert infill_prompt(qwen, enc, "p", "s", **big) == [
        4, *"myproject\n", 5, *"filename\n", 1, "p", 2, "s", 3]
    assert infill_prompt(plain, enc, "p", "s", "", [("a", "x"), ("b", "y")], **big) == [
        *SNIPPET, "x", *SNIPPET, "y", 1, "p", 2, "s", 3]
    # a batch of 8: the prefix's last 6, the suffix's first 8 / 4 - 2 - 1 = -1 -> 0
    assert infill_prompt(plain, enc, "abcdefghij", "klmn", "t", n_batch=8, n_ctx=100) == [
        1, *"efghij", "t", 2, 3]
    assert infill_prompt(plain, enc, "ab", "klmnopq", "", n_batch=16, n_ctx=100) == [
        1, "a", "b", 2, *"kl", 3]  # 16 / 4 - 2
    # the other files' last 30 - 16 - 2 * 5 = 4 tokens
    assert infill_prompt(plain, enc, "p", "s", "", [("a", "wxyz0123")], n_batch=16, n_ctx=30,
                         n_predict=5) == [*"0123", 1, "p", 2, "s", 3]
    assert infill_prompt(plain, enc, "p", "s", "", [("a", "xyz")], n_batch=16, n_ctx=16,
                         n_predict=1) == [1, "p", 2, "s", 3]  # no room past the batch
    # n_predict -1 (unbounded) counts as llama-server counts it: two tokens more room
    assert infill_prompt(plain, enc, "p", "s", "", [("a", "xyz")], n_batch=16,
                         n_ctx=16)[:2] == ["y", "z"]


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


SERVER_ARGS = ("--max-model-len", "256", "--max-num-batched-tokens", "64")


def test_infill_gives_the_fim_prompts_tokens(coder):
    import transformers

    server = shared_server(coder, *SERVER_ARGS)
    tok = transformers.AutoTokenizer.from_pretrained(coder)
    pre, suf, mid = tok.convert_tokens_to_ids(FIM)
    prefix, suffix = "def add(a, b):\n    return ", "\n\nprint(add(1, 2))\n"
    sampling = {"n_predict": 6, "temperature": 0, "ignore_eos": True}

    def ids(text: str) -> list[int]:
        return tok(text, add_special_tokens=False).input_ids

    repo, sep = tok.convert_tokens_to_ids(["<repo_name>", "<file_sep>"])
    # llama-server's repository header, with no other file: REPO myproject SEP filename
    header = [repo, *ids("myproject\n"), sep, *ids("filename\n")]
    want = header + tok("").input_ids + [pre, *ids(prefix), *ids("a"), suf, *ids(suffix), mid]
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
    # an editor's whole file: cut as llama-server cuts it, not refused
    long_prefix = "".join(f"x{i} = {i}\n" for i in range(300)) + prefix
    long_suffix = suffix + "".join(f"y{i} = {i}\n" for i in range(300))
    extra = [{"filename": "util.py", "text": "".join(f"z{i} = {i}\n" for i in range(300))}]
    status, _, cut = post(server, "/infill", {"input_prefix": long_prefix,
                                              "input_suffix": long_suffix, "prompt": "a",
                                              "input_extra": extra, **sampling})
    assert status == 200, cut
    # a batch of 64 (--max-num-batched-tokens): the prefix's last 48, the suffix's first 13;
    # past it, the other files' last 256 - 64 - 12 tokens
    other = [repo, *ids("myproject\n"), sep, *ids("util.py\n"), *ids(extra[0]["text"]), sep,
             *ids("filename\n")]
    want_cut = [*other[-180:], *tok("").input_ids, pre, *ids(long_prefix)[-48:], *ids("a"),
                suf, *ids(long_suffix)[:13], mid]
    _, _, same = post(server, "/completion", {"prompt": want_cut, **sampling})
    assert cut["tokens_evaluated"] == len(want_cut) <= 256 - 6
    assert cut["content"] == same["content"]
    assert_idle_and_free(server)


def test_a_model_without_the_tokens_has_no_infill(tiny_llama):
    server = robust_server(tiny_llama)
    status, _, err = post(server, "/infill", {"input_prefix": "def f():"})
    assert status == 404 and "fill-in-the-middle" in err["error"]["message"]
    assert "/infill" not in server.get_json("/openapi.json")["paths"]


def test_completions_suffix_inserts_on_a_code_model(coder):
    """OpenAI's ``suffix`` on /v1/completions (insertion) is the plain fill-in-the-middle
    prompt, PRE prompt SUF suffix MID (no repository header: that is /infill's, for editors);
    published in /openapi.json for such a model only."""
    import transformers

    server = shared_server(coder, *SERVER_ARGS)
    tok = transformers.AutoTokenizer.from_pretrained(coder)
    pre, suf, mid = tok.convert_tokens_to_ids(FIM)
    prefix, suffix = "def add(a, b):\n    return ", "\n\nprint(add(1, 2))\n"
    sampling = {"temperature": 0, "ignore_eos": True}
    want = [*tok("").input_ids, pre, *tok(prefix, add_special_tokens=False).input_ids, suf,
            *tok(suffix, add_special_tokens=False).input_ids, mid]
    _, _, same = post(server, "/completion", {"prompt": want, "n_predict": 6, **sampling})
    status, _, cmpl = post(server, "/v1/completions", {
        "prompt": prefix, "suffix": suffix, "max_tokens": 6, **sampling})
    assert status == 200, cmpl
    assert cmpl["choices"][0]["text"] == same["content"]
    assert cmpl["usage"]["prompt_tokens"] == len(want)
    status, _, err = post(server, "/v1/completions", {"prompt": prefix, "suffix": suffix,
                                                      "echo": True, "max_tokens": 2})
    assert status == 400 and err["error"]["param"] == "suffix"
    doc = server.get_json("/openapi.json")["components"]["schemas"]["CompletionRequest"]
    assert {"type": "string"} in doc["properties"]["suffix"]["anyOf"]
    assert "suffix" in doc["dependentSchemas"]
    assert_idle_and_free(server)
