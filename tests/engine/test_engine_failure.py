"""A dead engine makes `asyncengine serve` drain and exit non-zero, so that a supervisor
restarts it: a test plugin registers a model whose forward pass fails like a broken device
when it sees a poison token. A stream in flight gets an error event and [DONE], not a hang."""

from __future__ import annotations

import json
import os
import shutil
import textwrap
import time
from pathlib import Path

import aiohttp
import anyio
import pytest

from tests.server_utils import ServerProcess, sse_events

POISON = 4242
ARCH = "FaultyLlamaForCausalLM"
PLUGIN = f'''
    import torch

    from asyncengine.executor.models.llama import LlamaForCausalLM
    from asyncengine.plugins import hookimpl


    class FaultyLlama(LlamaForCausalLM):
        """The built-in Llama, whose device "breaks" on a step that holds token {POISON}."""

        def forward(self, input_ids, *args, **kwargs):
            if bool((input_ids == {POISON}).any()):
                raise RuntimeError("simulated device failure")
            return super().forward(input_ids, *args, **kwargs)


    @hookimpl
    def register_models(register):
        register("{ARCH}", FaultyLlama)
'''


def install_plugin(site: Path) -> None:
    """A distribution with one module and an `asyncengine` entry point, as pip installs it."""
    site.mkdir()
    (site / "faulty_model_plugin.py").write_text(textwrap.dedent(PLUGIN))
    info = site / "faulty_model_plugin-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: faulty-model-plugin\n"
                                   "Version: 1.0\n")
    (info / "entry_points.txt").write_text("[asyncengine]\nfaulty = faulty_model_plugin\n")


@pytest.fixture
def faulty_server(tiny_llama, tmp_path):
    model = tmp_path / "faulty-llama"
    shutil.copytree(tiny_llama, model)
    config = json.loads((model / "config.json").read_text())
    config["architectures"] = [ARCH]
    (model / "config.json").write_text(json.dumps(config))
    install_plugin(tmp_path / "site")
    path = os.pathsep.join([str(tmp_path / "site"), os.environ.get("PYTHONPATH", "")])
    server = ServerProcess(str(model), "--max-model-len", "512", "--num-gpu-blocks-override",
                           "128", env={"PYTHONPATH": path, "ASYNCENGINE_PLUGINS": "faulty"})
    yield server
    server.stop()
    Path(server._log.name).unlink(missing_ok=True)  # kept by stop() when the exit is non-zero


def test_engine_failure_fails_streams_and_exits_non_zero(faulty_server):
    server = faulty_server

    async def main():
        async with aiohttp.ClientSession() as session:
            stream = {"prompt": "Go on:", "max_tokens": 400, "ignore_eos": True,
                      "stream": True}
            async with session.post(server.url("/v1/completions"), json=stream) as resp:
                first = await resp.content.readline()
                assert first.startswith(b"data: {")
                poison = {"prompt": [POISON, 5, 6], "max_tokens": 4}
                async with session.post(server.url("/v1/completions"), json=poison) as r:
                    failed = r.status, await r.json()
                with anyio.fail_after(20):  # an error event, not a hang
                    rest = await resp.read()
            return first + rest, failed

    raw, (status, body) = anyio.run(main)
    events = sse_events(raw)
    assert events[-1] == "[DONE]"
    error = events[-2]["error"]
    assert error["type"] == "server_error" and "simulated device failure" in error["message"]
    assert all("choices" in e for e in events[:-2])
    assert status == 500 and "simulated device failure" in body["error"]["message"]
    started = time.monotonic()
    code = server.proc.wait(timeout=30)  # it exits by itself: no signal was sent
    assert code == 1, server.log()
    assert time.monotonic() - started < 15
    log = server.log()
    assert "the engine's step loop failed" in log
    assert "exiting with status 1" in log
