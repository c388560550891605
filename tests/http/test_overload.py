"""Overload is refused, not queued forever: past --max-queued-requests a request gets 503 with
Retry-After and OpenAI's error body at once; the accepted ones complete in full and the block
pool is free after. The drain-time 503 carries Retry-After too."""

from __future__ import annotations

import signal
import time

import aiohttp
import anyio
import pytest

from asyncengine.config import EngineConfig
from asyncengine.entrypoints.cli import build_parser
from tests.robust_utils import assert_idle_and_free
from tests.server_utils import ServerProcess

MAX_NUM_SEQS = 4
MAX_QUEUED = 8
NUM_REQUESTS = 120
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def server(tiny_llama):
    server = ServerProcess(tiny_llama, "--max-num-seqs", str(MAX_NUM_SEQS),
                           "--max-queued-requests", str(MAX_QUEUED), "--max-model-len", "256",
                           "--num-gpu-blocks-override", "256", "--shutdown-timeout", "5")
    yield server
    server.stop()


async def send(session: aiohttp.ClientSession, server: ServerProcess,
               i: int) -> tuple[int, dict, dict]:
    """Completions and chat completions, alternately."""
    body: dict = {"max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0}
    text = f"Request {i}: count to ten."
    if i % 2:
        body["messages"] = [{"role": "user", "content": text}]
        url = server.url("/v1/chat/completions")
    else:
        body["prompt"] = text
        url = server.url("/v1/completions")
    async with session.post(url, json=body) as resp:
        return resp.status, dict(resp.headers), await resp.json()


def test_surplus_gets_503_with_retry_after_and_the_rest_completes(server):
    async def storm():
        limits = aiohttp.TCPConnector(limit=0)  # all at once
        async with aiohttp.ClientSession(connector=limits) as session:
            results: list = [None] * NUM_REQUESTS

            async def one(i: int) -> None:
                results[i] = await send(session, server, i)

            async with anyio.create_task_group() as tg:
                for i in range(NUM_REQUESTS):
                    tg.start_soon(one, i)
            return results

    started = time.monotonic()
    results = anyio.run(storm)
    elapsed = time.monotonic() - started
    ok = [body for status, _, body in results if status == 200]
    refused = [(headers, body) for status, headers, body in results if status == 503]
    assert len(ok) + len(refused) == NUM_REQUESTS, {s for s, _, _ in results}
    # At most the queue plus what runs was accepted; the rest was refused at once.
    assert MAX_NUM_SEQS <= len(ok) <= NUM_REQUESTS - len(refused)
    assert len(refused) >= NUM_REQUESTS - 4 * (MAX_NUM_SEQS + MAX_QUEUED), len(ok)
    for body in ok:
        assert body["usage"]["completion_tokens"] == MAX_TOKENS
        assert body["choices"][0]["finish_reason"] == "length"
    for headers, body in refused:
        assert int(headers["Retry-After"]) >= 1
        err = body["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert err["type"] == "service_unavailable" and err["code"] == "overloaded"
        assert "--max-queued-requests 8" in err["message"]
    assert elapsed < 60
    assert_idle_and_free(server)


def test_drain_503_carries_retry_after(server):
    async def main():
        async with aiohttp.ClientSession() as session:
            body = {"prompt": "Go on:", "max_tokens": 200, "ignore_eos": True, "stream": True}
            async with session.post(server.url("/v1/completions"), json=body) as resp:
                assert (await resp.content.readline()).startswith(b"data: {")
                server.signal(signal.SIGTERM)
                with anyio.fail_after(10):
                    while True:
                        async with session.get(server.url("/v1/models")) as r:
                            if r.status == 503:
                                return r.headers.get("Retry-After"), await r.json()
                        await anyio.sleep(0.02)

    retry_after, body = anyio.run(main)
    assert retry_after is not None and int(retry_after) >= 1
    assert "shutting down" in body["error"]["message"]
    assert server.proc.wait(timeout=30) == 0


def test_queue_limit_flag_and_default():
    assert EngineConfig().scheduler.queued_request_limit == 256
    assert EngineConfig.from_dict({"max_num_seqs": 128}).scheduler.queued_request_limit == 512
    args = build_parser().parse_args(["serve", "--max-queued-requests", "12", "--max-n", "4",
                                      "--max-logprobs", "5"])
    config = EngineConfig.from_cli(args)
    assert config.scheduler.queued_request_limit == 12
    assert config.scheduler.max_n == 4 and config.model.max_logprobs == 5
    for flags, flag in ((["--max-queued-requests", "0"], "--max-queued-requests"),
                        (["--max-n", "0"], "--max-n"), (["--max-logprobs", "-1"],
                                                        "--max-logprobs")):
        with pytest.raises(ValueError, match=flag):
            EngineConfig.from_cli(build_parser().parse_args(["serve", *flags]))
