"""SIGTERM: new requests get 503, in-flight ones finish within --shutdown-timeout, the rest
are aborted (an error event ends their stream), and the process exits 0."""

from __future__ import annotations

import json
import signal
import time

import aiohttp
import anyio

from tests.server_utils import KEY, ServerProcess, sse_events

SHUTDOWN_TIMEOUT = 6.0  # long enough for the short request on a loaded 2-core machine
# The long request must outlast the window on a fast machine too: one tiny-model stream of
# 3,500 tokens took 8.7 s on a 2-core Zen 4, and 8 samples with logprobs 33.6 s.
LONG_N = 8


def test_sigterm_drains_then_exits_0(tiny_llama):
    # Its own server (this test ends it), with a drain window a slow machine can keep.
    server = ServerProcess(tiny_llama, "--shutdown-timeout", str(SHUTDOWN_TIMEOUT),
                           "--num-gpu-blocks-override", "1024", api_key=KEY)
    try:
        short_tokens = 12

        async def main():
            async with aiohttp.ClientSession(headers=server.headers()) as session:
                long_body = {"prompt": "Go on forever:", "max_tokens": 3500, "ignore_eos": True,
                             "stream": True, "n": LONG_N, "logprobs": 5}
                short_body = {"prompt": "Count:", "max_tokens": short_tokens,
                              "ignore_eos": True}
                async with session.post(server.url("/v1/completions"), json=long_body) as resp:
                    first = await resp.content.readline()  # generation is under way
                    assert first.startswith(b"data: {")
                    async with anyio.create_task_group() as tg:
                        short: dict = {}

                        async def run_short():
                            async with session.post(server.url("/v1/completions"),
                                                    json=short_body) as r:
                                short["status"], short["body"] = r.status, await r.json()

                        tg.start_soon(run_short)
                        deadline = time.monotonic() + 10
                        while server.get_json("/health")["num_requests_running"] < LONG_N + 1:
                            assert time.monotonic() < deadline
                            await anyio.sleep(0.01)
                        sent = time.monotonic()
                        server.signal(signal.SIGTERM)
                        while True:  # the signal arrives; from then on, 503
                            async with session.get(server.url("/v1/models")) as r:
                                if r.status == 503:
                                    refused = await r.json()
                                    break
                            await anyio.sleep(0.02)
                    rest = await resp.read()
                    ended = time.monotonic() - sent
            return first + rest, short, refused, ended

        stream, short, refused, ended = anyio.run(main)
        assert refused["error"]["type"] == "service_unavailable"
        assert "shutting down" in refused["error"]["message"]
        # The short request finished within the drain window, in full.
        assert short["status"] == 200, short
        assert short["body"]["usage"]["completion_tokens"] == short_tokens
        # The long one was aborted when the window closed: an error event, then [DONE].
        events = sse_events(stream)
        assert events[-1] == "[DONE]"
        assert events[-2]["error"]["type"] == "service_unavailable", json.dumps(events[-2])
        assert "aborted" in events[-2]["error"]["message"]
        assert all("choices" in e for e in events[:-2])
        assert SHUTDOWN_TIMEOUT - 0.5 < ended < SHUTDOWN_TIMEOUT + 5
        assert server.proc.wait(timeout=30) == 0
    finally:
        server.stop()
