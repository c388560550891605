"""``asyncengine bench models --cycles``: load/unload cycles of one model while another
streams, in a router server (a subprocess): the resident set after each unload, the requests
lost, the other model's longest stall."""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import anyio

from asyncengine.entrypoints.bench import models as bench_models
from asyncengine.entrypoints.bench.models_cycles import format_cycles, run_cycles


def test_cycles_report_rss_losses_and_stalls(tiny_models, tmp_path: Path):
    for family in ("llama", "qwen2"):
        shutil.copytree(tiny_models[family], tmp_path / family)
    parser = argparse.ArgumentParser()
    bench_models.add_arguments(parser)
    args = parser.parse_args([
        "--models-dir", str(tmp_path), "--model", "qwen2", "--light", "llama",
        "--concurrency", "2", "--max-tokens", "8", "--cycles", "2", "--start-timeout", "120",
        "--server-args", "--dtype float32 --num-gpu-blocks-override 64"])
    figures = anyio.run(run_cycles, args)
    assert len(figures["rss"]) == 2 and all(v > 0 for v in figures["rss"])
    assert figures["requests"] >= 2 and figures["lost"] == 0
    assert figures["gap_unload"] >= 0 and figures["gap_other"] > 0
    text = format_cycles(figures, args)
    assert "2 load/unload cycles of qwen2 while llama serves 2 streams" in text
    assert "lost 0" in text
