"""`asyncengine bench peers`: missing peers are reported, not errors; the ratios printed are
ours over theirs; a peer that cannot start is reported as failed."""

from __future__ import annotations

import asyncio
import sys

from asyncengine.entrypoints.bench import peers
from asyncengine.entrypoints.cli import build_parser


def _args(*argv: str):
    return build_parser().parse_args(["bench", "peers", *argv])


def test_missing_peers_are_reported_as_not_installed(tmp_path):
    args = _args("--llama-server", str(tmp_path / "nowhere"), "--vllm-python", sys.executable)
    assert peers.server_command("llama-server", args, 1234).startswith("not installed")
    # this environment has no vllm
    assert peers.server_command("vllm", args, 1234).startswith("not installed")
    cmd = peers.server_command("asyncengine", args, 1234)
    assert cmd[:4] == [sys.executable, "-m", "asyncengine", "serve"] and "1234" in cmd


def test_llama_server_command_serves_the_embedded_gguf(tmp_path):
    fake = tmp_path / "llama-server"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    args = _args("--llama-server", str(fake), "--threads", "2", "--concurrency", "1", "32")
    cmd = peers.server_command("llama-server", args, 4321)
    assert cmd[0] == str(fake) and cmd[cmd.index("-m") + 1].endswith(".gguf")
    assert cmd[cmd.index("-t") + 1] == "2" and cmd[cmd.index("-np") + 1] == "32"


def test_a_peer_that_exits_is_reported_as_failed(tmp_path):
    fake = tmp_path / "llama-server"
    fake.write_text("#!/bin/sh\necho broken build >&2\nexit 3\n")
    fake.chmod(0o755)
    args = _args("--llama-server", str(fake), "--start-timeout", "20")
    got = asyncio.run(peers.run_peer("llama-server", args, seed=0))
    assert isinstance(got, str) and got.startswith("failed") and "broken build" in got


def test_table_prints_ours_over_theirs():
    def summary(tps: float, itl: float) -> dict:
        return {"output_throughput": tps, "median_itl_ms": itl, "failed": 0}

    table = peers.format_table({
        "asyncengine": {1: summary(40.0, 20.0), 32: summary(300.0, 90.0)},
        "llama-server": {1: summary(80.0, 10.0), 32: summary(150.0, 200.0)},
        "vllm": "not installed (vllm is not importable by python)",
    }, [1, 32])
    lines = table.splitlines()
    assert any(line.startswith("llama-server") and line.endswith("0.50x") for line in lines)
    assert any(line.startswith("llama-server") and line.endswith("2.00x") for line in lines)
    assert any(line.startswith("vllm") and "not installed" in line for line in lines)
