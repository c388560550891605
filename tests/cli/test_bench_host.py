"""``asyncengine bench host`` on a small load: its three consumer modes; the rows' structure
and invariants (no timing assertions: the machine is shared)."""

from __future__ import annotations

import json
import shutil

from asyncengine.engine.step_loop import PHASES
from asyncengine.entrypoints.bench import host
from asyncengine.entrypoints.cli import build_parser
from tests.utils import embedded_tokenizer_dir


def _model_dir(root, config):  # the tokenizer converted once per machine, not per run
    shutil.copytree(embedded_tokenizer_dir(), root)
    (root / "config.json").write_text(json.dumps(config))
    return str(root)


def test_host_benchmark_rows_add_up(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(host, "make_model_dir", _model_dir)
    out = tmp_path / "host.json"
    args = build_parser().parse_args([
        "bench", "host", "--streams", "3", "--tokens", "8", "--prompt-tokens", "20",
        "--consumers", "http", "generate", "batch", "--t-gpu-ms", "1", "--json", str(out)])
    assert host.main(args) == 0
    rows = json.loads(out.read_text())
    assert [r["consumers"] for r in rows] == ["http", "generate", "batch"]
    for r in rows:
        assert r["streams"] == 3 and r["delivered"] == r["expected"] == 24
        assert r["blocks_free_after"]
        assert r["steps"] >= 8 and r["stream_steps"] >= 24
        cpu = r["cpu_s"]
        assert set(cpu) == {*PHASES, "consumers", "rest", "total", "timing"}
        assert all(cpu[k] >= 0 for k in (*PHASES, "consumers"))
        assert sum(cpu[k] for k in (*PHASES, "consumers")) <= cpu["total"]
        assert cpu["prepare"] > 0 and cpu["enqueue"] > 0 and cpu["emit"] > 0
        assert cpu["consumers"] > 0  # the handlers, the generate() tasks, or the batch's
        per_step = r["ms_per_step"]["total"] / 1e3 * r["steps"]
        assert abs(per_step - cpu["total"]) < 1e-9
        assert r["wakeups_per_stream_step"] > 0
        gpu = r["gpu"]
        assert gpu["t_gpu_ms"] == 1.0  # --t-gpu-ms alone: a constant
        # Requests that arrive a step apart decode together for fewer steps: at least one.
        assert gpu["full_batch_steps"] >= 1
        for key in ("idle_percent", "run_idle_percent", "one_core_idle_percent"):
            assert 0 <= gpu[key] <= 100
    assert rows[0]["client_cpu_us_per_token"] > 0
    printed = capsys.readouterr().out
    assert "consumers: batch (in-process engine.generate_many()" in printed
    assert "consumers: generate (in-process engine.generate()" in printed
    assert "emission with the SSE writes" in printed


def test_step_time_flags():
    parse = build_parser().parse_args
    t = host.step_time(parse(["bench", "host"]))
    assert abs(t(1) - 2.120e-3) < 1e-6 and abs(t(256) - 3.33e-3) < 2e-6  # the H100's 1B steps
    t = host.step_time(parse(["bench", "host", "--t-gpu-ms", "3.5"]))
    assert t(1) == t(1024) == 3.5e-3
    t = host.step_time(parse(["bench", "host", "--t-gpu-per-token-us", "10"]))
    assert abs(t(100) - (host.H100_1B_FIXED_MS + 1.0) / 1e3) < 1e-9
