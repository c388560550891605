"""The example third-party plugin, examples/shortest_prompt_first: its scheduling policy in the
engine, and the package installed into a fresh environment and served by `asyncengine serve`."""

from __future__ import annotations

import json
import os
import shutil
import site
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import anyio
import pytest

import asyncengine
from asyncengine.config import EngineConfig
from asyncengine.core.sampling_params import SamplingParams
from asyncengine.engine.engine import AsyncEngine
from asyncengine.ext.registry import ALLOWLIST_ENV, new_plugin_manager

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "shortest_prompt_first"
SERVER = Path(asyncengine.__file__).parent / "http" / "server.py"
ENGINE_FLAGS = {"dtype": "float32", "block_size": 8, "num_gpu_blocks_override": 64,
                "max_model_len": 128}
LONG = "Once upon a time, in a land far away, there lived a king who had three daughters and"
SHORT = "Hello"


async def finishing_order(engine: AsyncEngine) -> list[str]:
    """Queue a long prompt, then a short one, before the engine's first step; one request
    runs at a time (max_num_seqs=1). Returns the prompts in the order they finished."""
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    order: list[str] = []

    async def drain(name: str, stream) -> None:
        async for _ in stream:
            pass
        order.append(name)

    async with engine, anyio.create_task_group() as tg:
        # add_request does not yield to the loop, so both are waiting at the first schedule().
        long_stream = await engine.add_request(LONG, params)
        short_stream = await engine.add_request(SHORT, params)
        tg.start_soon(drain, "long", long_stream)
        tg.start_soon(drain, "short", short_stream)
    return order


def test_spf_admits_the_shortest_waiting_prompt_first(tiny_llama, monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLE))
    import asyncengine_spf.plugin

    pm = new_plugin_manager(load_entrypoints=False)
    pm.register(asyncengine_spf.plugin, name="spf")
    config = EngineConfig.from_dict({"model": tiny_llama, "max_num_seqs": 1,
                                     "max_num_batched_tokens": 64, **ENGINE_FLAGS})
    fcfs = AsyncEngine(config, plugin_manager=pm)
    assert anyio.run(finishing_order, fcfs) == ["long", "short"]
    spf = AsyncEngine(config.replace(scheduler="spf"), plugin_manager=pm)
    assert type(spf.scheduler).__name__ == "ShortestPromptFirstScheduler"
    assert anyio.run(finishing_order, spf) == ["short", "long"]
    for name in [m for m in sys.modules if m.startswith("asyncengine_spf")]:
        monkeypatch.delitem(sys.modules, name)


@pytest.fixture(scope="module")
def venv_with_example(tmp_path_factory) -> Path:
    """A new virtual environment holding the example plugin, installed with pip."""
    root = tmp_path_factory.mktemp("spf-env")
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip",
                    str(venv)], check=True)
    python = venv / "bin" / "python"
    # --system-site-packages exposes the base interpreter's packages, not those of the
    # environment running the tests (torch, asyncengine, pip, setuptools): add them.
    purelib = subprocess.check_output(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        text=True).strip()
    lines = "; ".join(f"site.addsitedir({d!r})" for d in site.getsitepackages())
    Path(purelib, "_outer_env.pth").write_text(f"import site; {lines}\n")
    source = shutil.copytree(EXAMPLE, root / "src")  # the build writes next to the sources
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--no-deps",
                    "--no-build-isolation", "--no-index", str(source)], check=True)
    return python


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_json(url: str, body: dict | None = None) -> dict:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as response:
        assert response.status == 200
        return json.loads(response.read())


@pytest.mark.skipif(not SERVER.exists(),
                    reason="asyncengine serve (asyncengine/http/server.py) is not written yet")
def test_installed_example_serves_requests(venv_with_example, tiny_llama, tmp_path):
    python = venv_with_example
    found = subprocess.check_output(
        [str(python), "-c", "import importlib.metadata as m; "
         "print(sorted(e.name for e in m.entry_points(group='asyncengine')))"], text=True)
    assert found.strip() == "['builtins', 'spf']"

    port = free_port()
    command = [str(python), "-m", "asyncengine", "serve", tiny_llama, "--scheduler", "spf",
               "--port", str(port), "--max-num-seqs", "4", "--max-num-batched-tokens", "64"]
    for key, value in ENGINE_FLAGS.items():
        command += [f"--{key.replace('_', '-')}", str(value)]
    env = {**os.environ, ALLOWLIST_ENV: "spf"}
    log = tmp_path / "server.log"
    with open(log, "wb") as out:
        server = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            assert server.poll() is None, f"the server exited:\n{log.read_text()}"
            assert time.monotonic() < deadline, f"no /health after 90 s:\n{log.read_text()}"
            try:
                urllib.request.urlopen(f"{base}/health", timeout=2).close()
                break
            except OSError:
                time.sleep(0.2)
        [model] = get_json(f"{base}/v1/models")["data"]
        reply = get_json(f"{base}/v1/completions", {
            "model": model["id"], "prompt": ["The capital of France is", "Hi"],
            "max_tokens": 5, "temperature": 0, "ignore_eos": True})
        assert [c["index"] for c in reply["choices"]] == [0, 1]
        assert all(c["finish_reason"] == "length" and c["text"] for c in reply["choices"])
        assert reply["usage"]["completion_tokens"] == 10
    finally:
        server.terminate()
        server.wait(timeout=30)

    # Left out of the allowlist, the plugin is not loaded, and start-up would say so.
    result = subprocess.run(
        [str(python), "-c", "from asyncengine.ext.registry import resolve_scheduler; "
         "resolve_scheduler('spf')"],
        env={**os.environ, ALLOWLIST_ENV: ""}, capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert "--scheduler: scheduler 'spf' is not registered" in result.stderr
    assert "ASYNCENGINE_PLUGINS leaves them out: spf" in result.stderr
