"""llama-server's own routes (``entrypoints/http/llama_server/completion.py``): POST /completion
answers as llama-server does, with the tokens /v1/completions gives for the same sampling, streamed
and not; GET /props gives the context and the slots."""

from __future__ import annotations

import json

import pytest

from tests.robust_utils import assert_idle_and_free, post, robust_server
from tests.server_utils import sse_events


@pytest.fixture(scope="module")
def server(tiny_llama):
    return robust_server(tiny_llama)


PROMPT = "The capital of France is"


def test_completion_gives_v1_completions_tokens(server):
    status, _, want = post(server, "/v1/completions", {
        "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True})
    assert status == 200
    status, _, got = post(server, "/completion", {
        "prompt": PROMPT, "n_predict": 8, "temperature": 0, "ignore_eos": True,
        "return_tokens": True, "cache_prompt": True, "id_slot": -1, "samplers": ["top_k"]})
    assert status == 200, got
    assert got["content"] == want["choices"][0]["text"] and got["stop"] is True
    assert got["tokens_predicted"] == 8 == len(got["tokens"]) and got["stop_type"] == "limit"
    assert got["tokens_evaluated"] == want["usage"]["prompt_tokens"]
    assert got["prompt"] == PROMPT and got["timings"]["predicted_n"] == 8
    assert got["generation_settings"]["n_predict"] == 8
    # the same through /completions, from token ids
    _, _, ids = post(server, "/tokenize", {"prompt": PROMPT})
    _, _, again = post(server, "/completions", {"prompt": ids["tokens"], "n_predict": 8,
                                                "temperature": 0, "ignore_eos": True})
    assert again["content"] == got["content"]
    assert_idle_and_free(server)


def test_streamed_completion_and_a_stopping_word(server):
    body = {"prompt": PROMPT, "n_predict": 12, "temperature": 0, "ignore_eos": True}
    _, _, whole = post(server, "/completion", body)
    status, headers, raw = post(server, "/completion", {**body, "stream": True})
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    assert "[DONE]" not in raw  # llama-server's streams end with the stop event
    events = sse_events(raw.encode())
    assert all(e["stop"] is False for e in events[:-1]) and events[-1]["stop"] is True
    assert "".join(e["content"] for e in events) == whole["content"]
    assert events[-1]["tokens_predicted"] == 12 and events[-1]["stop_type"] == "limit"
    # a stop string met in the output: stop_type "word", the word named, the text before it
    word = whole["content"].strip().split()[1]
    _, _, cut = post(server, "/completion", {**body, "stop": [word]})
    assert cut["stop_type"] == "word" and cut["stopping_word"] == word
    assert whole["content"].startswith(cut["content"]) and word not in cut["content"]
    assert_idle_and_free(server)


def test_nothing_predicted_and_what_is_refused(server):
    _, _, ids = post(server, "/tokenize", {"prompt": PROMPT})
    status, _, none = post(server, "/completion", {"prompt": PROMPT, "n_predict": 0})
    assert status == 200 and none["content"] == "" and none["tokens_predicted"] == 0
    assert none["tokens_evaluated"] == len(ids["tokens"])
    for field, value in (("mirostat", 2), ("n_probs", 5), ("typical_p", 0.5),
                         ("logit_bias", [[15, -100]])):
        status, _, err = post(server, "/completion", {"prompt": PROMPT, field: value})
        assert status == 400 and field in json.dumps(err), (field, err)
    status, _, err = post(server, "/completion", {
        "prompt": PROMPT, "json_schema": {"type": "object"}, "grammar": 'root ::= "a"'})
    assert status == 400 and err["error"]["param"] == "grammar"
    status, _, err = post(server, "/completion", {"prompt": []})
    assert status == 400
    assert_idle_and_free(server)


def test_props(server):
    props = server.get_json("/props")
    health = server.get_json("/v1/models")["data"][0]
    assert props["default_generation_settings"]["n_ctx"] == health["max_model_len"]
    assert props["total_slots"] == 16 and props["model_alias"] == health["id"]


def test_tokenize_and_detokenize_in_llama_servers_form(server):
    _, _, vllm = post(server, "/tokenize", {"prompt": PROMPT, "add_special_tokens": False})
    status, _, llama = post(server, "/tokenize", {"content": PROMPT})
    assert status == 200 and llama["tokens"] == vllm["tokens"]
    status, _, err = post(server, "/tokenize", {"content": PROMPT, "prompt": PROMPT})
    assert status == 400 and "exactly one of prompt, messages and content" in json.dumps(err)
    _, _, text = post(server, "/detokenize", {"tokens": llama["tokens"]})
    assert text["content"] == text["prompt"] == PROMPT
