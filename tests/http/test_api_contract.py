"""The published API says what the server accepts, and a refused request starts no work.

- A request refused for any of its parts (a multi-prompt completion with one bad prompt)
  leaves every engine counter where it was: nothing was queued, nothing aborted.
- Every integer field has its range, in the document and in the server (a value outside it
  is a 400 naming the field); empty input is a 400 on every generation route.
- /openapi.json states what the server enforces (``openapi_ranges.py``); schemathesis, run
  against it in ``test_schemathesis.py``, finds nothing the two disagree on.
"""

from __future__ import annotations

import re

import pytest

from tests.robust_utils import assert_idle_and_free, post, robust_server
from tests.server_utils import ServerProcess

CMPL, CHAT, RESP, EMBED = "/v1/completions", "/v1/chat/completions", "/v1/responses", \
    "/v1/embeddings"
USER = [{"role": "user", "content": "hi"}]
HUGE = 1180591620717411303424  # 2**70


@pytest.fixture(scope="module")
def server(tiny_llama) -> ServerProcess:
    return robust_server(tiny_llama)


_SAMPLE = re.compile(r"^((?:asyncengine|vllm):\w+(?:_total|_count|_sum)?)(\{[^}]*\})? (\S+)$",
                     re.M)


def counters(server: ServerProcess) -> dict[str, float]:
    """Every counter and histogram count/sum of the engine's /metrics, by name and labels."""
    text = server.metrics()
    return {name + labels: float(value) for name, labels, value in _SAMPLE.findall(text)
            if name.endswith(("_total", "_count", "_sum"))}


def error(status: int, body, param: str | None = None) -> str:
    assert status == 400, body
    assert body["error"]["type"] == "invalid_request_error", body
    if param is not None:  # the field, or an item of it (``stop_token_ids[0]``)
        assert body["error"]["param"].split("[")[0] == param, body
    return body["error"]["message"]


def test_a_refused_multi_prompt_request_starts_no_work(server):
    post(server, CMPL, {"prompt": "warm", "max_tokens": 1})  # every counter exists
    assert_idle_and_free(server)
    before = counters(server)
    refused = [
        {"prompt": [[1, 2], [49152]], "max_tokens": 2},  # the case
        {"prompt": [[1, 2], [3] * 70], "max_tokens": 2},  # a later prompt past the context
        {"prompt": ["fine", ""], "max_tokens": 2},  # a later prompt empty
        {"prompt": ["a", "b"], "max_tokens": 2, "structured_outputs": {"regex": "("}},
    ]
    for body in refused:
        status, _, answer = post(server, CMPL, body)
        assert status == 400, (body, answer)
    assert counters(server) == before
    assert_idle_and_free(server)
    # The same call, valid, runs every prompt.
    status, _, answer = post(server, CMPL, {"prompt": [[1, 2], [3, 4]], "max_tokens": 2})
    assert status == 200 and len(answer["choices"]) == 2, answer
    assert_idle_and_free(server)


@pytest.mark.parametrize("path, extra, param", [
    (CMPL, {"stop_token_ids": [-1]}, "stop_token_ids"),
    (CMPL, {"stop_token_ids": [HUGE]}, "stop_token_ids"),
    (CMPL, {"stop_token_ids": [49152]}, "stop_token_ids"),  # past the vocabulary
    (CMPL, {"priority": HUGE}, "priority"),
    (CMPL, {"priority": -HUGE}, "priority"),
    (CHAT, {"priority": HUGE}, "priority"),
    (CMPL, {"best_of": HUGE}, "best_of"),
    (CMPL, {"min_tokens": HUGE}, "min_tokens"),
    (CMPL, {"min_tokens": 64}, "min_tokens"),  # no prompt leaves room for 64 in 64
    (CMPL, {"max_tokens": 64}, "max_tokens"),
    (CHAT, {"max_completion_tokens": HUGE}, "max_completion_tokens"),
    (CHAT, {"top_logprobs": HUGE, "logprobs": True}, "top_logprobs"),
    (CMPL, {"logit_bias": {"+5": 1}}, "logit_bias"),  # keys as the document spells them
    (RESP, {"max_output_tokens": HUGE}, "max_output_tokens"),
    (EMBED, {"truncate_prompt_tokens": HUGE}, "truncate_prompt_tokens"),
    (EMBED, {"dimensions": -HUGE}, "dimensions"),
])
def test_every_integer_field_has_its_range(server, path, extra, param):
    base = {CMPL: {"prompt": "hi", "max_tokens": 2}, CHAT: {"messages": USER, "max_tokens": 2},
            RESP: {"input": "hi"}, EMBED: {"input": "hi"}}[path]
    before = counters(server)
    message = error(*_status_body(post(server, path, {**base, **extra})), param)
    assert param in message
    assert counters(server) == before


def test_detokenize_tokens_have_the_vocabulary_range(server):
    for tokens in ([-1], [HUGE], [49152]):
        status, _, body = post(server, "/detokenize", {"tokens": tokens})
        assert status == 400 and body["error"]["param"].startswith("tokens"), body


@pytest.mark.parametrize("path, body, param", [
    (CMPL, {"prompt": ""}, "prompt"),
    (CMPL, {"prompt": []}, "prompt"),
    (CMPL, {"prompt": [[]]}, "prompt"),
    (CHAT, {"messages": []}, "messages"),
    (RESP, {"input": ""}, "input"),  # the case: was a 200
    (RESP, {"input": []}, "input"),
    (EMBED, {"input": ""}, "input"),
    (EMBED, {"input": []}, "input"),
])
def test_empty_input_is_refused_everywhere(server, path, body, param):
    before = counters(server)
    message = error(*_status_body(post(server, path, body)))
    assert "empty" in message, message
    assert counters(server) == before


def test_integral_numbers_are_integers_and_tags_are_required(server):
    # JSON Schema counts 2.0 as an integer, so the server does too.
    status, _, body = post(server, CMPL, {"prompt": [1.0, 2.0], "max_tokens": 2.0, "n": 1e0})
    assert status == 200 and body["usage"]["completion_tokens"] <= 2, body
    status, _, body = post(server, CMPL, {"prompt": "hi", "max_tokens": 2.5})
    assert status == 400 and body["error"]["param"] == "max_tokens", body
    # A content part without its type is not a text part.
    status, _, body = post(server, CHAT, {"messages": [{"role": "user",
                                                        "content": [{"text": "hi"}]}]})
    assert status == 400 and "type" in body["error"]["message"], body
    assert_idle_and_free(server)


def test_a_405_lists_the_allowed_methods(server):
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.request("DELETE", CMPL)
    resp = conn.getresponse()
    resp.read()
    assert resp.status == 405
    assert "POST" in resp.getheader("Allow", "")


def _integers(schema, path: str, out: list[tuple[str, dict]], components, seen) -> None:
    if isinstance(schema, dict):
        ref = schema.get("$ref")
        if ref is not None:
            name = ref.rsplit("/", 1)[1]
            if name not in seen:
                seen.add(name)
                _integers(components[name], name, out, components, seen)
            return
        if schema.get("type") == "integer":
            out.append((path, schema))
        for key, value in schema.items():
            if key in ("properties", "$defs"):
                for name, sub in value.items():
                    _integers(sub, f"{path}.{name}", out, components, seen)
            elif key not in ("const", "enum", "default", "examples"):
                _integers(value, path, out, components, seen)
    elif isinstance(schema, list):
        for item in schema:
            _integers(item, path, out, components, seen)


def test_the_document_bounds_every_integer_of_every_request_body(server):
    doc = server.get_json("/openapi.json")
    components = doc["components"]["schemas"]
    found: list[tuple[str, dict]] = []
    for path, ops in doc["paths"].items():
        for op in ops.values():
            body = op.get("requestBody", {}).get("content", {}).get("application/json", {})
            if body:
                _integers(body["schema"], path, found, components, set())
    assert len(found) > 20
    for where, schema in found:
        assert "minimum" in schema, (where, schema)
        # top_k: past the vocabulary means all tokens (documented in its description).
        assert "maximum" in schema or where.endswith("top_k"), (where, schema)
    # What the served model and the flags decide is in the document too.
    cmpl = components["CompletionRequest"]["properties"]
    names = [m["id"] for m in server.get_json("/v1/models")["data"]]
    assert cmpl["model"]["anyOf"][0]["enum"] == names
    assert cmpl["max_tokens"]["anyOf"][0]["maximum"] == 63
    token = cmpl["prompt"]["anyOf"][2]["items"]
    assert token == {"type": "integer", "minimum": 0, "maximum": 49151}
    assert components["ChatCompletionRequest"]["properties"]["messages"]["minItems"] == 1


def _status_body(result):
    status, _, body = result
    return status, body


def test_a_request_that_fails_alone_is_a_4xx_not_a_500():
    # schemathesis found it: a constrained request whose sampling left no valid token ended
    # in RequestFailed, which reached the client as a bare 500.
    from asyncengine.engine.errors import RequestFailed
    from asyncengine.entrypoints.http.serving import to_api_error

    err = to_api_error(RequestFailed("request r failed: no valid next token"))
    assert err.status == 400 and err.code == "request_failed"
    assert "no valid next token" in err.message
