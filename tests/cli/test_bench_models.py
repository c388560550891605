"""``asyncengine bench models``: its flags and its report (the run itself starts servers:
docs/benchmarks.md has its figures)."""

from __future__ import annotations

from asyncengine.entrypoints.bench.models import format_figures
from asyncengine.entrypoints.cli import build_parser


def test_the_flags_parse_and_the_report_names_every_figure():
    args = build_parser().parse_args(["bench", "models", "--models-dir", "/m", "--light", "t",
                                      "--repeats", "2"])
    assert args.bench_command == "models" and args.concurrency == 32 and args.model == "default"
    pair = (0.01, 0.02)
    text = format_figures({"cold": 3.0, "fresh": 4.0, "warm": pair, "sleep1": pair,
                           "sleep2": pair, "switch": pair, "light_alone": pair,
                           "light_loaded": pair, "heavy_loaded": pair, "light": "t",
                           "heavy": "default"}, args)
    assert "cold load of default" in text and "3000.0 ms" in text
    assert "t while default serves 32 streams" in text and "(median 20.0)" in text
