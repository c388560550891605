"""Property-based: random sampling parameters (extreme integers and floats, NaN and infinity
as raw JSON text, strings and other types where numbers belong) sent to the real server never
get a 5xx or a failed stream, and leave the engine healthy with every KV block free."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.robust_utils import assert_idle_and_free, post_raw, robust_server
from tests.server_utils import ServerProcess, sse_events

EXTREME_INTS = [0, 1, -1, 2, 20, 21, 128, 129, 49151, 49152, 2**31, 2**53 + 1, 2**63 - 1,
                2**63, -(2**63), -(2**63) - 1, 2**64 - 1, 2**64, 10**30, -(10**30)]
EXTREME_FLOATS = [0.0, -0.0, 1e-300, 5e-324, 1e-50, 0.01, 0.5, 1.0, 2.0, 100.0, 1e4, 1e4 + 1,
                  1e38, 1e39, 1.7976931348623157e308, -1e39, math.nan, math.inf, -math.inf]
NOT_NUMBERS = [None, True, False, "1", "NaN", "", [], [1], {}, {"a": 1}]

number = st.one_of(
    st.sampled_from(EXTREME_INTS), st.sampled_from(EXTREME_FLOATS),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True, width=64),
    st.sampled_from(NOT_NUMBERS))

NUMERIC = ["temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
           "repetition_penalty", "seed", "n", "min_tokens", "logprobs", "priority"]
small_max_tokens = st.integers(min_value=1, max_value=4)

logit_bias = st.dictionaries(
    st.one_of(st.sampled_from(["0", "5", "49151", "49152", "-1", "x", "1e3"]),
              st.integers(min_value=-(2**64), max_value=2**64).map(str)),
    number, max_size=3)


@st.composite
def requests(draw) -> tuple[str, bytes, bool]:
    chat = draw(st.booleans())
    params = draw(st.dictionaries(st.sampled_from(NUMERIC), number, max_size=5))
    if chat and "logprobs" in params:  # chat's logprobs is a bool; top_logprobs the number
        params["top_logprobs"] = params.pop("logprobs")
        params["logprobs"] = True
    if draw(st.booleans()):
        params["logit_bias"] = draw(logit_bias)
    params["max_tokens"] = draw(st.one_of(small_max_tokens, number))
    stream = draw(st.booleans())
    body = {**params, "stream": stream}
    if chat:
        body["messages"] = [{"role": "user", "content": "hi"}]
    else:
        body["prompt"] = draw(st.sampled_from(["hi", "hi hi hi", [5, 6, 7]]))
    # json.dumps writes NaN and Infinity as bare words: not JSON, as a hostile client sends.
    raw = json.dumps(body).encode()
    return ("/v1/chat/completions" if chat else "/v1/completions"), raw, stream


@pytest.fixture(scope="module")
def server(tiny_llama) -> ServerProcess:
    return robust_server(tiny_llama)


def test_random_sampling_parameters_never_hurt_the_server(server):
    seen: dict[int, int] = {}

    @settings(max_examples=80, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(requests())
    def one(request: tuple[str, bytes, bool]) -> None:
        path, raw, stream = request
        status, headers, body = post_raw(server, path, raw)
        seen[status] = seen.get(status, 0) + 1
        assert status < 500, (raw[:300], body)
        if status != 200:
            assert set(body["error"]) == {"message", "type", "param", "code"}, body
        elif stream:
            events = sse_events(body.encode())
            assert events[-1] == "[DONE]", events[-3:]
            assert not [e for e in events if isinstance(e, dict) and "error" in e], events[-3:]

    one()
    assert seen.get(200, 0) >= 5 and seen.get(400, 0) >= 20, seen  # both kinds were sent
    assert_idle_and_free(server)
