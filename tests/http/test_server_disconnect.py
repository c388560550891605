"""Clients that go away: their engine requests are aborted at once and their blocks freed,
seen from outside through /metrics and /health."""

from __future__ import annotations

import json
import os
import socket
import time

import aiohttp
import anyio
import pytest

from tests.server_utils import KEY, ServerProcess, tiny_server

MAX_TOKENS = 160
DROP_AFTER = 4  # chunks


@pytest.fixture(scope="module")
def server(tiny_llama) -> ServerProcess:
    return tiny_server(tiny_llama)


def aborted(server: ServerProcess) -> float:
    return server.metric("asyncengine:request_finished_total", finished_reason="abort")


def wait_idle(server: ServerProcess, aborts: float, timeout: float = 10) -> dict:
    """Poll until ``aborts`` aborts were counted and no request is left; /health then."""
    deadline = time.monotonic() + timeout
    while True:
        health = server.get_json("/health")
        if aborted(server) >= aborts and health["num_requests_running"] == 0 \
                and health["num_requests_waiting"] == 0:
            return health
        if time.monotonic() > deadline:
            return health
        time.sleep(0.05)


def open_fds(server: ServerProcess) -> int:
    return len(os.listdir(f"/proc/{server.proc.pid}/fd"))


def test_dropped_streams_are_aborted_and_the_rest_complete(server):
    before = aborted(server)
    fds = open_fds(server)

    async def one(session: aiohttp.ClientSession, i: int, drop: bool):
        body = {"prompt": f"Request number {i} says", "max_tokens": MAX_TOKENS,
                "ignore_eos": True, "temperature": 0.7, "seed": i, "stream": True,
                "stream_options": {"include_usage": True}}
        chunks, finish, tokens = 0, None, 0
        async with session.post(server.url("/v1/completions"), json=body) as resp:
            assert resp.status == 200
            async for line in resp.content:
                if not line.startswith(b"data: {"):
                    continue
                chunks += 1
                event = json.loads(line[6:])
                if event["choices"] and event["choices"][0]["finish_reason"]:
                    finish = event["choices"][0]["finish_reason"]
                if event["usage"]:
                    tokens = event["usage"]["completion_tokens"]
                if drop and chunks == DROP_AFTER:
                    resp.connection.transport.abort()  # the client vanishes mid-stream
                    return "dropped", chunks
        return finish, tokens

    async def main():
        connector = aiohttp.TCPConnector(limit=0, force_close=True)
        async with aiohttp.ClientSession(connector=connector, headers=server.headers()) \
                as session:
            return await _gather([one(session, i, i % 2 == 0) for i in range(32)])

    results = anyio.run(main)
    assert results[0::2] == [("dropped", DROP_AFTER)] * 16
    # Every kept stream got all its tokens and finished by length.
    assert results[1::2] == [("length", MAX_TOKENS)] * 16
    health = wait_idle(server, before + 16)
    assert aborted(server) - before == 16
    assert health["num_free_blocks"] == health["num_total_blocks"]
    assert server.metric("asyncengine:kv_cache_free_blocks") == health["num_total_blocks"]
    assert server.metric("asyncengine:num_requests_running") == 0
    # Every socket, and every descriptor the batch sender duplicated, was closed.
    deadline = time.monotonic() + 10
    while open_fds(server) > fds and time.monotonic() < deadline:
        time.sleep(0.05)
    assert open_fds(server) <= fds


def test_dropped_non_streaming_request_is_aborted(server):
    before = aborted(server)
    # Two prompts: two engine requests behind one HTTP request.
    body = b'{"prompt": ["A long answer:", "Another"], "max_tokens": 3000, "ignore_eos": true}'
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n")
        sock.sendall(head.encode() + body)
        deadline = time.monotonic() + 10
        while server.get_json("/health")["num_requests_running"] < 2:
            assert time.monotonic() < deadline, "the request never started"
            time.sleep(0.02)
    started = time.monotonic()
    health = wait_idle(server, before + 2)
    assert aborted(server) - before == 2
    assert health["num_free_blocks"] == health["num_total_blocks"]
    assert time.monotonic() - started < 5  # far sooner than 3000 tokens would take


async def _gather(coros):
    results = [None] * len(coros)

    async def run(i, coro):
        results[i] = await coro

    async with anyio.create_task_group() as tg:
        for i, coro in enumerate(coros):
            tg.start_soon(run, i, coro)
    return results
