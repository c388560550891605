"""The command line as a newcomer meets it: generate with no model, config from YAML, errors
that name the flag."""

from __future__ import annotations

import subprocess
import sys

import pytest

from asyncengine.config import EngineConfig, parse_size
from asyncengine.entrypoints.cli import build_parser


def run_cli(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "asyncengine", *args], capture_output=True,
                          text=True, timeout=timeout)


def test_generate_with_the_embedded_model_answers():
    r = run_cli("generate", "What is the capital of France?", "--max-tokens", "24")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout


def test_bad_flag_value_names_the_flag():
    r = run_cli("generate", "hi", "--block-size", "12")
    assert r.returncode == 2
    assert "--block-size" in r.stderr and "power of two" in r.stderr
    assert "Traceback" not in r.stderr
    r = run_cli("generate", "hi", "--dtype", "fp8")
    assert r.returncode == 2 and "--dtype" in r.stderr and "bfloat16" in r.stderr


def test_missing_model_is_a_clear_error(tmp_path):
    r = run_cli("generate", "hi", "--model", str(tmp_path / "nope.gguf"))
    assert r.returncode == 2
    assert "Traceback" not in r.stderr and "nope.gguf" in r.stderr


def test_yaml_config_and_flags_precedence(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("max-num-seqs: 7\ncache:\n  block_size: 32\nscheduler:\n  scheduler: priority\n")
    args = build_parser().parse_args(["serve", "--config", str(cfg), "--max-num-seqs", "3"])
    c = EngineConfig.from_cli(args)
    assert c.scheduler.max_num_seqs == 3  # the flag wins
    assert c.cache.block_size == 32 and c.scheduler.scheduler == "priority"


def test_yaml_errors(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("max-num-sequences: 4\n")
    with pytest.raises(ValueError, match="unknown config key 'max_num_sequences'"):
        EngineConfig.from_dict(EngineConfig.from_yaml(bad))
    with pytest.raises(ValueError, match="--config: file not found"):
        EngineConfig.from_yaml(tmp_path / "missing.yaml")
    with pytest.raises(ValueError, match="--max-num-seqs: must be a positive integer"):
        EngineConfig.from_dict({"max_num_seqs": 0})


def test_sizes():
    assert parse_size("2GiB") == 2 * 2**30
    assert parse_size("512MB") == 512 * 10**6
    with pytest.raises(ValueError, match="--kv-cache-memory"):
        EngineConfig.from_dict({"kv_cache_memory": "lots"})
