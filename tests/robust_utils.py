"""The server the robustness, fuzzing and schemathesis tests share, and raw HTTP helpers.

A short context (64 tokens) keeps every generation short whatever a generated request asks
for (a chat request without max_tokens runs to the end of the context)."""

from __future__ import annotations

import http.client
import json
from typing import Any

from tests.server_utils import ServerProcess, shared_server

MAX_MODEL_LEN = 64


def robust_server(tiny_llama: str) -> ServerProcess:
    return shared_server(tiny_llama, "--max-model-len", str(MAX_MODEL_LEN),
                         "--num-gpu-blocks-override", "128", "--max-num-seqs", "16",
                         "--shutdown-timeout", "2")


def post_raw(server: ServerProcess, path: str, data: bytes,
             timeout: float = 60) -> tuple[int, dict[str, str], Any]:
    """POST ``data`` as is; (status, headers, JSON body or text)."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=timeout)
    try:
        conn.request("POST", path, data, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        payload = resp.read()
        headers = {k.lower(): v for k, v in resp.getheaders()}
    finally:
        conn.close()
    if headers.get("content-type", "").startswith("application/json"):
        return resp.status, headers, json.loads(payload)
    return resp.status, headers, payload.decode(errors="replace")


def post(server: ServerProcess, path: str, body: Any, timeout: float = 60):
    return post_raw(server, path, json.dumps(body).encode(), timeout)


def assert_idle_and_free(server: ServerProcess, timeout: float = 20) -> dict:
    """/health is 200, nothing runs or waits, and every KV block is free (polls a moment:
    a request may still be finishing after its client got its response)."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        health = server.get_json("/health")
        idle = health["num_requests_running"] == health["num_requests_waiting"] == 0
        if idle and health["num_free_blocks"] == health["num_total_blocks"]:
            return health
        assert time.monotonic() < deadline, health
        time.sleep(0.05)
