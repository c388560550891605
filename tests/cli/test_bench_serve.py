"""``asyncengine bench serve`` against the real server (loopback only)."""

from __future__ import annotations

import argparse
import json

import pytest

from asyncengine.entrypoints.bench import serve as bench_serve
from tests.server_utils import KEY, ServerProcess, tiny_server


@pytest.fixture(scope="module")
def server(tiny_llama) -> ServerProcess:
    return tiny_server(tiny_llama)


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench_serve.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_synthetic_prompts_are_seeded_and_about_the_right_length():
    a = bench_serve.synthetic_prompts(4, 50, seed=1)
    assert a == bench_serve.synthetic_prompts(4, 50, seed=1)
    assert a != bench_serve.synthetic_prompts(4, 50, seed=2)
    assert len(set(a)) == 4 and all(len(p.split()) == 50 for p in a)


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_bench_reports_every_request(server, tmp_path, capsys, endpoint):
    out = tmp_path / "result.json"
    rc = bench_serve.main(parse(
        "--base-url", server.base_url, "--api-key", KEY, "--endpoint", endpoint,
        "--num-prompts", "6", "--concurrency", "3", "--max-tokens", "8", "--prompt-len", "20",
        "--ignore-eos", "--request-rate", "50", "--save-result", str(out)))
    assert rc == 0
    report = capsys.readouterr().out
    for line in ("Successful requests:", "Output token throughput (tok/s):", "Median TTFT (ms):",
                 "P99 ITL (ms):", "Mean TPOT (ms):", "Median E2EL (ms):"):
        assert line in report
    result = json.loads(out.read_text())
    assert result["completed"] == 6 and result["failed"] == 0
    assert result["total_output_tokens"] == 48 and result["output_lens"] == [8] * 6
    assert all(n >= 20 for n in result["input_lens"])  # ~1 token per word, chat adds more
    assert 0 < result["median_ttft_ms"] <= result["median_e2el_ms"]
    assert result["output_throughput"] == pytest.approx(48 / result["duration"])
    assert result["max_concurrency"] == 3 and result["config"]["api_key"] is None


def test_bench_fails_cleanly(server, capsys):
    assert bench_serve.main(parse("--base-url", server.base_url, "--num-prompts", "2",
                                  "--model", "x")) == 1
    assert "HTTP 401" in capsys.readouterr().err
    assert bench_serve.main(parse("--base-url", "ftp://x")) == 2
