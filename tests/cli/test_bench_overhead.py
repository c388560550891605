"""`asyncengine bench overhead` runs end to end on a small load: the bare server and the null
runner over real HTTP, with every figure the note quotes (tokens/s, ratio, loop and step-path
CPU per stream and step, the bare server's CPU per chunk, the device's waiting share, each
server process's CPU per token)."""

from __future__ import annotations

import json

from asyncengine.entrypoints.bench import overhead
from asyncengine.entrypoints.cli import build_parser


def test_overhead_benchmark_runs_and_reports_every_figure(tmp_path, capsys):
    out = tmp_path / "overhead.json"
    args = build_parser().parse_args(["bench", "overhead", "--streams", "4", "--tokens", "8",
                                      "--runners", "null", "--json", str(out)])
    assert overhead.main(args) == 0
    bare, null = json.loads(out.read_text())
    assert bare["server"] == "bare" and bare["tokens_per_s"] > 0 and bare["loop_us_per_chunk"] > 0
    assert bare["client_us_per_chunk"] > 0
    assert null["server"] == "null" and null["tokens_per_s"] > 0 and null["steps"] >= 8
    assert 0 < null["step_path_us_per_stream_step"] < null["loop_us_per_stream_step"]
    assert 0 <= null["device_wait_frac"] <= 1
    # The servers' whole process, from /proc (10 ms ticks: a run this small may read 0).
    assert bare["process_us_per_token"] >= 0 and null["process_us_per_token"] >= 0
    printed = capsys.readouterr().out
    assert "null runner,     4 streams x 8 tokens" in printed and "x bare" in printed
    assert "its client" in printed
