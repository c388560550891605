"""Every error the server answers, with its status code and OpenAI's error body."""

from __future__ import annotations

import http.client
import json

import openai
import pytest

from tests.server_utils import KEY, ServerProcess, tiny_server

MAX_LEN = 4096  # the tiny model's context
MAX_BODY = 2**20  # the shared server's --max-request-body


@pytest.fixture(scope="module")
def server(tiny_llama) -> ServerProcess:
    return tiny_server(tiny_llama)


def call(server: ServerProcess, method: str, path: str, body: object = None, *,
         raw: bytes | None = None, key: str | None = KEY) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    conn.request(method, path, data, headers)
    resp = conn.getresponse()
    payload = resp.read()
    conn.close()
    if resp.getheader("Content-Type", "").startswith("application/json"):
        return resp.status, json.loads(payload)
    return resp.status, {"text": payload.decode()}


def error_of(status: int, body: dict, expected_status: int) -> dict:
    assert status == expected_status, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert "Traceback" not in err["message"]
    return err


def test_api_key_required_except_health_and_metrics(server):
    for key in (None, "wrong-key", KEY[:-1]):
        err = error_of(*call(server, "GET", "/v1/models", key=key), 401)
        assert err["code"] == "invalid_api_key"
    error_of(*call(server, "POST", "/v1/completions", {"prompt": "x"}, key=None), 401)
    error_of(*call(server, "GET", "/no/such/route", key=None), 401)
    error_of(*call(server, "GET", "/openapi.json", key=None), 401)
    assert call(server, "GET", "/health", key=None)[0] == 200
    assert call(server, "GET", "/metrics", key=None)[0] == 200
    assert call(server, "GET", "/v1/models")[0] == 200
    client = openai.OpenAI(base_url=server.url("/v1"), api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        client.models.list()


def test_unknown_model_route_and_method(server):
    err = error_of(*call(server, "POST", "/v1/completions", {"model": "gpt-9", "prompt": "x"}),
                   404)
    assert "gpt-9" in err["message"] and err["code"] == "model_not_found"
    error_of(*call(server, "POST", "/v1/chat/completions",
                   {"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]}), 404)
    error_of(*call(server, "GET", "/v1/models/gpt-9"), 404)
    err = error_of(*call(server, "GET", "/v1/nothing"), 404)
    assert "/v1/nothing" in err["message"]
    err = error_of(*call(server, "DELETE", "/v1/completions"), 405)
    assert "POST" in err["message"]
    client = openai.OpenAI(base_url=server.url("/v1"), api_key=KEY, max_retries=0)
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-9", prompt="x")
    assert e.value.body["code"] == "model_not_found"


def test_body_too_large_and_malformed(server):
    err = error_of(*call(server, "POST", "/v1/completions", {"prompt": "x" * MAX_BODY}), 413)
    assert str(MAX_BODY) in err["message"]
    err = error_of(*call(server, "POST", "/v1/completions", raw=b'{"prompt": "x",'), 400)
    assert "JSON" in err["message"]
    error_of(*call(server, "POST", "/v1/completions", raw=b"[1, 2]"), 400)
    error_of(*call(server, "POST", "/v1/completions", raw=b""), 400)


@pytest.mark.parametrize("body, param, says", [
    ({"prompt": "x", "suffix": "y"}, "suffix", "suffix"),
    ({"prompt": "x", "best_of": 2}, "best_of", "best_of"),
    ({"prompt": "x", "n": "two"}, "n", "int"),
    ({"prompt": "x", "temperature": -1}, "temperature", "temperature"),
    ({"prompt": "x", "top_p": 1.5}, "top_p", "top_p"),
    ({"prompt": "x", "n": 0}, "n", "at least 1"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens", "max_tokens"),
    ({"prompt": "x", "logprobs": 50}, "logprobs", "logprobs"),
    ({"prompt": "x", "logit_bias": {"abc": 1}}, "logit_bias", "abc"),
    ({"prompt": "x", "logit_bias": {"99999999": 1}}, "logit_bias", "vocabulary"),
    ({"prompt": [], "max_tokens": 1}, "prompt", "prompt"),
    ({"prompt": ["a", [1]]}, "prompt", "prompt"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options",
     "stream=True"),
    ({"prompt": "x", "response_format": {"type": "json_object"},
      "structured_outputs": {"regex": "a+"}}, "structured_outputs", "structured_outputs"),
    ({"prompt": "x", "structured_outputs": {"regex": "a+", "choice": ["a"]}},
     "structured_outputs", "exactly one"),
    ({"prompt": "x", "response_format": {"type": "xml"}}, "response_format.type", "xml"),
])
def test_invalid_completion_parameters(server, body, param, says):
    err = error_of(*call(server, "POST", "/v1/completions", body), 400)
    assert err["param"] == param
    assert says in err["message"]


@pytest.mark.parametrize("body, param", [
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]},
     "messages[0].tool_calls"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "u"}]}]},
     "messages[0].content[0].type"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": []}, "tools"),
])
def test_invalid_chat_parameters(server, body, param):
    err = error_of(*call(server, "POST", "/v1/chat/completions", body), 400)
    assert err["param"] == param


def test_prompt_too_long_names_both_numbers(server):
    ids = list(range(100, 100 + MAX_LEN + 36))
    err = error_of(*call(server, "POST", "/v1/completions", {"prompt": ids}), 400)
    assert str(MAX_LEN) in err["message"] and str(len(ids)) in err["message"]
    err = error_of(*call(server, "POST", "/v1/completions",
                         {"prompt": list(range(100, 4100)), "max_tokens": 200}), 400)
    assert str(MAX_LEN) in err["message"] and "4200" in err["message"]
    err = error_of(*call(server, "POST", "/v1/completions", {"prompt": [10**9]}), 400)
    assert "vocabulary" in err["message"]
    client = openai.OpenAI(base_url=server.url("/v1"), api_key=KEY, max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=None, prompt=ids, stream=True)
    assert str(MAX_LEN) in e.value.body["message"]


def test_invalid_json_schema(server):
    body = {"messages": [{"role": "user", "content": "x"}],
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "s", "schema": {"type": "bogus"}}}}
    err = error_of(*call(server, "POST", "/v1/chat/completions", body), 400)
    assert "schema" in err["message"].lower()
    err = error_of(*call(server, "POST", "/v1/completions",
                         {"prompt": "x", "structured_outputs": {"regex": "(unclosed"}}), 400)

