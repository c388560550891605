"""No request can hurt another: hostile parameter values, bodies that are not UTF-8 or nest
thousands of levels deep, grammars no output can satisfy and malformed HTTP all get an
answer below 500 over real HTTP, and the server stays healthy and correct afterwards."""

from __future__ import annotations

import json
import socket
import time

import pytest

from tests.robust_utils import assert_idle_and_free, post, post_raw, robust_server
from tests.server_utils import ServerProcess

CHAT = "/v1/chat/completions"
CMPL = "/v1/completions"
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server(tiny_llama) -> ServerProcess:
    return robust_server(tiny_llama)


def greedy(server: ServerProcess) -> str:
    status, _, body = post(server, CMPL, {"prompt": "The capital of France is", "max_tokens": 8,
                                          "temperature": 0})
    assert status == 200, body
    return body["choices"][0]["text"]


def deep_schema(levels: int) -> str:
    """A JSON schema, as text, of arrays nested ``levels`` deep."""
    return '{"type": "array", "items": ' * levels + '{"type": "integer"}' + "}" * levels


# (path, raw body, expected status: None = anything below 500)
HOSTILE: list[tuple[str, bytes, int | None]] = [
    (CMPL, b'{"prompt":"hi","max_tokens":2,"seed":18446744073709551616}', 400),
    (CMPL, b'{"prompt":"hi","max_tokens":2,"seed":18446744073709551615,"n":2}', 400),
    (CMPL, b'{"prompt":"hi","max_tokens":2,"seed":9223372036854775807,"n":2}', 400),
    (CHAT, json.dumps({"messages": MESSAGES, "seed": -9223372036854775809}).encode(), 400),
    (CMPL, b'{"prompt":"hi","max_tokens":2,"top_k":9223372036854775808}', 200),
    (CMPL, b'{"prompt":"hi hi hi","max_tokens":4,"repetition_penalty":1e-50}', 400),
    (CMPL, b'{"prompt":"hi","max_tokens":4,"temperature":1e39,"min_tokens":2}', 400),
    (CHAT, json.dumps({"messages": MESSAGES, "temperature": 1e39,
                       "response_format": {"type": "json_object"}}).encode(), 400),
    (CHAT, json.dumps({"messages": MESSAGES, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#"}}}}).encode(),
     400),
    # Not UTF-8, inside a string and outside of one.
    (CMPL, b'{"prompt":"\xff\xfe","max_tokens":2}', 400),
    (CMPL, b'\xff{"prompt":"hi"}', 400),
    # 2,000 levels: as a schema object, as a schema string, as a prompt.
    (CHAT, (b'{"messages":[{"role":"user","content":"hi"}],"response_format":{"type":'
            b'"json_schema","json_schema":{"name":"x","schema":' + deep_schema(2000).encode()
            + b"}}}"), 400),
    (CHAT, json.dumps({"messages": MESSAGES,
                       "structured_outputs": {"json": deep_schema(2000)}}).encode(), 400),
    (CMPL, b'{"prompt":' + b"[" * 2000 + b"]" * 2000 + b"}", 400),
    # Numbers JSON cannot hold, or that float64 cannot.
    (CMPL, b'{"prompt":"hi","temperature":NaN}', 400),
    (CMPL, b'{"prompt":"hi","top_p":1e400}', 400),
    (CMPL, b'{"prompt":"hi","max_tokens":' + b"9" * 5000 + b"}", 400),
    (CMPL, b'{"prompt":"hi","logit_bias":{"' + b"1" * 5000 + b'":1}}', 400),
]


def test_hostile_requests_are_refused_and_the_server_stays_correct(server):
    before = greedy(server)
    answers = []
    for path, raw, _ in HOSTILE:
        status, _, body = post_raw(server, path, raw)
        answers.append((path, raw[:100], status, body))
        if status >= 400:  # OpenAI's error body, never a traceback
            assert set(body["error"]) == {"message", "type", "param", "code"}, body
            assert "Traceback" not in body["error"]["message"]
    server_errors = [a for a in answers if a[2] >= 500]
    assert not server_errors, server_errors
    mismatched = [a for a, (_, _, expected) in zip(answers, HOSTILE, strict=True)
                  if expected is not None and a[2] != expected]
    assert not mismatched, mismatched
    assert_idle_and_free(server)
    assert greedy(server) == before


@pytest.mark.parametrize("path, body, param, says", [
    (CMPL, {"n": 129}, "n", "128"),
    (CMPL, {"logprobs": 21}, "logprobs", "20"),
    (CHAT, {"logprobs": True, "top_logprobs": 21}, "top_logprobs", "20"),
    (CMPL, {"temperature": 10001}, "temperature", "[0, 10000]"),
    (CMPL, {"top_p": 0}, "top_p", "(0, 1]"),
    (CMPL, {"min_p": 1.5}, "min_p", "[0, 1]"),
    (CMPL, {"presence_penalty": -2.5}, "presence_penalty", "[-2, 2]"),
    (CMPL, {"frequency_penalty": 3}, "frequency_penalty", "[-2, 2]"),
    (CMPL, {"repetition_penalty": 0}, "repetition_penalty", "[0.01, 100]"),
    (CMPL, {"repetition_penalty": 1e30}, "repetition_penalty", "[0.01, 100]"),
    (CMPL, {"logit_bias": {"5": 101}}, "logit_bias", "[-100, 100]"),
    (CMPL, {"seed": 2**63}, "seed", "64 bits"),
    (CMPL, {"seed": 2**63 - 3, "n": 4}, "seed", "seed + n - 1"),
    (CMPL, {"top_k": -2}, "top_k", "top_k"),
    (CMPL, {"max_tokens": 2**64}, "max_tokens", "max_tokens"),
    (CHAT, {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": json.loads(deep_schema(70))}}}, "response_format", "64 levels"),
])
def test_out_of_range_values_name_the_parameter(server, path, body, param, says):
    base = {"prompt": "hi", "max_tokens": 2} if path == CMPL else {"messages": MESSAGES,
                                                                    "max_tokens": 2}
    status, _, answer = post(server, path, {**base, **body})
    assert status == 400, answer
    assert answer["error"]["param"] == param
    assert says in answer["error"]["message"]


def test_values_at_the_edges_of_the_ranges_are_served(server):
    edges = {"temperature": 10000, "top_p": 1e-300, "min_p": 1, "presence_penalty": -2,
             "frequency_penalty": 2, "repetition_penalty": 0.01, "seed": -(2**63),
             "top_k": 10**30, "logit_bias": {"0": -100, "5": 100}, "min_tokens": 3}
    status, _, body = post(server, CMPL, {"prompt": "hi hi hi", "max_tokens": 3,
                                          "ignore_eos": True, **edges})
    assert status == 200, body
    assert body["usage"]["completion_tokens"] == 3
    status, _, body = post(server, CMPL, {"prompt": "hi", "max_tokens": 2, "n": 2,
                                          "seed": 2**63 - 2, "repetition_penalty": 100})
    assert status == 200, body
    assert_idle_and_free(server)


def test_a_malformed_request_line_is_one_log_line(server):
    before = server.log().splitlines()
    for raw in (b"GET /\x00 HTTP/1.1\r\n\r\n", b"GET / HTTP/1.1\r\nBad Header\r\n\r\n"):
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
            s.sendall(raw)
            assert s.recv(64).startswith(b"HTTP/1.0 400")
    deadline = time.monotonic() + 5
    while len(server.log().splitlines()) < len(before) + 2:
        assert time.monotonic() < deadline, server.log()
        time.sleep(0.05)
    time.sleep(0.2)
    new = server.log().splitlines()[len(before):]
    assert len(new) == 2, new
    assert all("WARNING" in line and "400" in line for line in new), new
    assert "Traceback" not in "\n".join(new)
    assert_idle_and_free(server)
