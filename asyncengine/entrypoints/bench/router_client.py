"""A router server in a subprocess, and the client's time to first token
(``bench models`` and ``bench models --cycles``)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import tempfile
import time
from typing import Any


def _spawn(argv: list[str], port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "asyncengine", "serve", *argv, "--port", str(port),
           "--disable-access-log", "--log-level", "warning"]
    log = tempfile.TemporaryFile()  # a pipe left unread could block the server
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log)
    proc.log = log  # type: ignore[attr-defined]  (read when it exits early)
    return proc


async def _wait_ready(session: Any, proc: subprocess.Popen, url: str, timeout: float) -> None:
    import aiohttp

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            proc.log.seek(0)
            raise RuntimeError(f"the server exited with {proc.returncode}: "
                               f"{proc.log.read().decode(errors='replace')[-2000:]}")
        try:
            async with session.get(url + "/health") as r:
                if r.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.05)
    raise RuntimeError(f"the server did not start in {timeout:.0f}s")


async def ttft(session: Any, url: str, model: str | None, max_tokens: int = 1,
               prompt: str = "Tell me about the sea.") -> float:
    """Seconds from sending a streamed completion to its first token."""
    body: dict[str, Any] = {"prompt": prompt, "max_tokens": max_tokens, "stream": True,
                            "temperature": 0, "ignore_eos": True}
    if model is not None:
        body["model"] = model
    start = time.perf_counter()
    first = None
    async with session.post(url + "/v1/completions", json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"{model}: {r.status} {await r.text()}")
        async for line in r.content:
            if first is None and line.startswith(b"data: {") and b'"text"' in line:
                first = time.perf_counter() - start
    assert first is not None
    return first
