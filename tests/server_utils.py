"""Start the real server (``python -m asyncengine serve``) in a subprocess for HTTP tests."""

from __future__ import annotations

import atexit
import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

STARTUP_TIMEOUT_S = 180
#: The API key of the shared test server.
KEY = "test-secret-key"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """In the server, before exec: on Linux it gets SIGTERM when the test process dies, so a
    killed pytest leaves no server behind (atexit does not run then)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class ServerProcess:
    """A running ``asyncengine serve``; ``base_url`` is ``http://127.0.0.1:PORT``."""

    def __init__(self, model: str | None, *args: str, env: dict[str, str] | None = None,
                 api_key: str | None = None) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        cmd = [sys.executable, "-m", "asyncengine", "serve", *([model] if model else []),
               "--port", str(self.port), "--disable-access-log", *args]
        if api_key:
            cmd += ["--api-key", api_key]
        self._log = tempfile.NamedTemporaryFile(prefix="asyncengine-server-", suffix=".log",
                                                delete=False)
        self.proc = subprocess.Popen(
            cmd, stdout=self._log, stderr=subprocess.STDOUT,
            env={**os.environ, "TOKENIZERS_PARALLELISM": "false", **(env or {})},
            cwd=Path(__file__).resolve().parent.parent, preexec_fn=_die_with_parent)
        self._wait_ready()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}:\n"
                                   f"{self.log()}")
            try:
                with urllib.request.urlopen(self.base_url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.2)
        log = self.log()
        self.stop()
        raise RuntimeError(f"the server did not start in {STARTUP_TIMEOUT_S}s:\n{log}")

    def log(self) -> str:
        return Path(self._log.name).read_text(errors="replace")

    def url(self, path: str) -> str:
        return self.base_url + path

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def get_json(self, path: str) -> Any:
        req = urllib.request.Request(self.url(path), headers=self.headers())
        with urllib.request.urlopen(req, timeout=30) as r:
            return json.loads(r.read())

    def metrics(self) -> str:
        with urllib.request.urlopen(self.url("/metrics"), timeout=30) as r:
            return r.read().decode()

    def metric(self, name: str, **labels: str) -> float:
        """The value of one sample of /metrics (labels must match those given)."""
        for line in self.metrics().splitlines():
            if not line.startswith(name + "{") and not line.startswith(name + " "):
                continue
            if all(f'{k}="{v}"' in line for k, v in labels.items()):
                return float(line.rsplit(" ", 1)[1])
        raise KeyError(f"{name} {labels} not in /metrics")

    def signal(self, signum: int = signal.SIGTERM) -> None:
        self.proc.send_signal(signum)

    def stop(self, timeout: float = 60) -> int:
        """SIGTERM, then wait; the exit status (SIGKILL after ``timeout``)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        if self.proc.returncode == 0:  # keep the log of a server that failed
            Path(self._log.name).unlink(missing_ok=True)
        return self.proc.returncode


_shared: dict[tuple, ServerProcess] = {}


def shared_server(model: str | None, *args: str, **kwargs: Any) -> ServerProcess:
    """One server per (model, flags) for the whole test session (startup costs seconds);
    stopped when the session ends."""
    key = (model, args, tuple(sorted(kwargs.items())))
    server = _shared.get(key)
    if server is None or server.proc.poll() is not None:
        server = _shared[key] = ServerProcess(model, *args, **kwargs)
    return server


@atexit.register
def _stop_shared() -> None:
    for server in _shared.values():
        server.stop(timeout=20)


def tiny_server(tiny_llama: str) -> ServerProcess:
    """The tiny random llama (context 4096), shared by the HTTP test files: API key ``KEY``,
    1 MiB largest body, 2 s shutdown timeout, 1024 KV blocks (a small pool loads fast)."""
    return shared_server(tiny_llama, "--max-request-body", "1MiB", "--shutdown-timeout", "2",
                         "--num-gpu-blocks-override", "1024", api_key=KEY)


def sse_events(raw: bytes) -> list[Any]:
    """The ``data:`` payloads of an SSE body: JSON objects, and ``"[DONE]"``."""
    events = []
    for block in raw.decode().split("\n\n"):
        block = block.strip()
        if not block:
            continue
        assert block.startswith("data: "), block
        payload = block[len("data: "):]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


TEMPLATES = Path(__file__).resolve().parent / "templates"
#: The names the tool-calling test server answers to (--served-model-name).
TOOLS_SERVER_NAMES = ("tiny-tools", "tiny-alias")
ALLOWED_ORIGIN = "http://app.example"


def tools_server(tiny_llama: str) -> ServerProcess:
    """The tiny random llama with a Hermes-style chat template that renders tools, tool calls
    on (``--enable-auto-tool-choice --tool-call-parser hermes``), two served names, CORS for
    one origin and ``--root-path /llm``; API key ``KEY``. Shared by the drop-in test files."""
    return shared_server(
        tiny_llama, "--chat-template", str(TEMPLATES / "hermes_tools.jinja"),
        "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
        "--served-model-name", *TOOLS_SERVER_NAMES, "--allowed-origins", ALLOWED_ORIGIN,
        "--root-path", "/llm", "--num-gpu-blocks-override", "512", api_key=KEY)
