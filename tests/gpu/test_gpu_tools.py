"""The GPU run's tools, on the CPU: ``make gpu-wheelhouse`` (scripts/gpu_wheelhouse.py: the
trimmed FlashInfer wheel, the completeness check), ``make gpu-check`` (scripts/gpu_check.py:
the commands it runs, its report, with a stand-in interpreter), and benchmarks/gpu.py's
arithmetic and arguments (the HBM bound's bytes against transformers' own parameter count)."""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import stat
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def load(relative: str):
    path = ROOT / relative
    spec = importlib.util.spec_from_file_location(path.stem + "_under_test", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


wheelhouse = load("scripts/gpu_wheelhouse.py")
gpu_check = load("scripts/gpu_check.py")
gpu_session = load("scripts/gpu_session.py")
bench = load("benchmarks/gpu.py")


# -- make gpu-wheelhouse --------------------------------------------------------------------------

def test_flashinfer_trim_keeps_the_kernels_asyncengine_compiles():
    keep = wheelhouse.keep_in_flashinfer
    for path in ["flashinfer/data/csrc/batch_prefill.cu", "flashinfer/data/csrc/batch_decode.cu",
                 "flashinfer/data/csrc/batch_decode_kernel_inst.jinja",
                 "flashinfer/data/csrc/batch_prefill_paged_kernel_inst.jinja",
                 "flashinfer/data/csrc/sampling.cu", "flashinfer/data/csrc/renorm.cu",
                 "flashinfer/data/csrc/flashinfer_sampling_binding.cu",
                 "flashinfer/data/csrc/tvm_ffi_utils.h",
                 "flashinfer/data/csrc/group_gemm.cu", "flashinfer/data/csrc/bmm_fp8.cu",
                 "flashinfer/data/csrc/flashinfer_gemm_binding.cu",
                 "flashinfer/data/csrc/group_gemm_sm90.cu",
                 "flashinfer/data/csrc/group_gemm_sm90_kernel_inst.jinja",
                 "flashinfer/data/csrc/flashinfer_gemm_sm90_binding.cu",
                 "flashinfer/data/include/flashinfer/attention/decode.cuh",
                 "flashinfer/data/cutlass/include/cutlass/cutlass.h",
                 "flashinfer/data/cutlass/tools/util/include/cutlass/util/packed_stride.hpp",
                 "flashinfer/data/cccl/cub/cub/cub.cuh", "flashinfer/prefill.py",
                 "flashinfer/experimental/sm110_xqa/__init__.py"]:
        assert keep(path), path
    for path in ["flashinfer/data/csrc/fused_moe/x.cu", "flashinfer/data/csrc/batch_mla_run.cu",
                 "flashinfer/data/csrc/batch_decode_mla_run.cu",
                 "flashinfer/data/csrc/group_gemm_fp8_groupwise_sm100.cu",
                 "flashinfer/data/csrc/group_gemm_sm100_binding.cu",
                 "flashinfer/data/csrc/cake_fmha/kernel.cu",
                 "flashinfer/data/cutlass/examples/a.cu", "flashinfer/data/cutlass/python/x.py",
                 "flashinfer/data/cutlass/tools/profiler/x.cu", "flashinfer/data/cccl/python/x",
                 "flashinfer/experimental/sm110_xqa/csrc/k.cu",
                 "flashinfer/__pycache__/utils.cpython-312.pyc"]:
        assert not keep(path), path


def test_trimmed_wheel_has_a_matching_record(tmp_path):
    src = tmp_path / "flashinfer_python-0.7.2.post1-py3-none-any.whl"
    files = {"flashinfer/__init__.py": b"x = 1\n",
             "flashinfer/data/csrc/batch_decode.cu": b"// decode\n",
             "flashinfer/data/csrc/fused_moe.cu": b"// moe\n" * 100,
             "flashinfer_python-0.7.2.post1.dist-info/METADATA":
                 b"Name: flashinfer-python\nRequires-Dist: torch\nRequires-Dist: nccl4py\n"
                 b"Requires-Dist: rich; extra == 'b12x'\n"}
    with zipfile.ZipFile(src, "w") as z:
        for name, data in files.items():
            z.writestr(name, data)
        z.writestr("flashinfer_python-0.7.2.post1.dist-info/RECORD", "stale\n")
    dest = tmp_path / "out.whl"
    assert wheelhouse.trim_wheel(src, dest) == (3, 1)
    with zipfile.ZipFile(dest) as z:
        names = set(z.namelist())
        record = z.read("flashinfer_python-0.7.2.post1.dist-info/RECORD").decode().split()
    assert "flashinfer/data/csrc/fused_moe.cu" not in names
    for row in record[:-1]:
        name, digest, size = row.split(",")
        data = files[name]
        want = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        assert digest == f"sha256={want}" and int(size) == len(data)
    assert record[-1] == "flashinfer_python-0.7.2.post1.dist-info/RECORD,,"
    assert wheelhouse.requirements(dest) == {"torch", "nccl4py"}  # no extras
    assert "nccl4py" in wheelhouse.FLASHINFER_LAZY_DEPS


def test_wheelhouse_dry_run_pins_what_the_device_lacks(capsys):
    assert wheelhouse.main(["--dry-run"]) == 0
    out = capsys.readouterr().out
    for name in ("msgspec==", "xgrammar==", "gguf==", "aiohttp-cors==", "apache-tvm-ffi==",
                 "pydantic=="):
        assert name in out
    assert wheelhouse.FLASHINFER in out and "tokenizer" in out
    tomllib = pytest.importorskip("tomllib")

    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]["cuda"]
    assert extra == [wheelhouse.FLASHINFER]  # the pin and the wheelhouse agree


def test_every_runtime_dependency_is_on_the_device_or_in_the_wheelhouse(tmp_path):
    """A runtime dependency added to pyproject.toml must be on the GPU machine's image or in
    the wheelhouse's list, else `make gpu-check` would fail to import asyncengine there."""
    pytest.importorskip("tomllib")
    assert wheelhouse.uncovered() == set()
    fake = tmp_path / "pyproject.toml"
    fake.write_text('[project]\ndependencies = ["torch>=2", "msgspec", "zstandard>=0.2; '
                    'python_version>\'3\'"]\n')
    assert wheelhouse.uncovered(fake) == {"zstandard"}


# -- make gpu-check -------------------------------------------------------------------------------

def test_gpu_check_dry_run_runs_the_issue_s_commands(tmp_path, capsys):
    (tmp_path / "a-1.0-py3-none-any.whl").write_bytes(b"")
    assert gpu_check.main(["--dry-run", "--wheelhouse", str(tmp_path), "--report",
                           str(tmp_path / "r")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("PYTHONPATH=/tmp/asyncengine-site:")
    install, prewarm, test, bench_line = lines[1:]
    assert "--no-index --no-deps" in install and "a-1.0-py3-none-any.whl" in install
    assert "-m asyncengine.executor.runtime.prewarm" in prewarm
    assert "-m pytest -m gpu -rs" in test and "tests/gpu/test_gpu.py" in test
    assert "benchmarks/gpu.py --json" in bench_line
    assert "tests/gpu/test_gpu.py" in gpu_check.gpu_test_files()
    with pytest.raises(SystemExit):
        gpu_check.main(["--steps", "install,fly", "--dry-run"])
    with pytest.raises(SystemExit):  # no wheels: say how to make them
        gpu_check.main(["--steps", "install", "--wheelhouse", str(tmp_path / "none")])
    with pytest.raises(SystemExit):
        gpu_check.main(["--steps", "test", "--timeouts", "test=soon", "--dry-run"])


def test_gpu_check_runs_each_step_and_writes_the_report(tmp_path, capsys):
    """With a stand-in interpreter that prints what pytest and the benchmark print: every
    step's log, exit status and the report's summary of it."""
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\n"
                    "case \"$*\" in\n"
                    "  *torch.cuda*) echo '2.11.0 13.0 NVIDIA H100 80GB HBM3';;\n"
                    "  *benchmarks/gpu.py*) echo '[decode] 1.0 ms/token'; exit 3;;\n"
                    "  *-m\\ pytest*) echo 'tests/gpu/test_gpu.py ..s'; "
                    "echo 'SKIPPED [1] tests/gpu/test_gpu.py:90: the embedded model'; "
                    "echo '2 passed, 1 skipped in 9.00s'; exit 0;;\n"
                    "esac\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    report = tmp_path / "report"
    rc = gpu_check.main(["--steps", "test,bench", "--python", str(fake), "--report",
                         str(report), "--timeouts", "test=60,bench=60"])
    assert rc == 1  # the benchmark failed
    text = (report / "report.md").read_text()
    assert "device: 2.11.0 13.0 NVIDIA H100 80GB HBM3" in text
    assert "| test | 0 |" in text and "| bench | 3 |" in text
    assert "SKIPPED [1] tests/gpu/test_gpu.py:90: the embedded model" in text
    assert "2 passed, 1 skipped" in text and "[decode] 1.0 ms/token" in text
    assert (report / "pytest.log").read_text().startswith("$ ")


def test_gpu_session_runs_its_phases_side_by_side_within_the_deadline(tmp_path, capsys,
                                                                     monkeypatch):
    """make gpu-session with a stand-in interpreter: phase 2's six steps (five prewarms and
    the first tests) overlap, every step's log lands in one tarball beside report.md, and a
    phase that would start past the deadline does not run."""
    import tarfile
    import time

    (tmp_path / "wh").mkdir()
    (tmp_path / "wh" / "a-1.0-py3-none-any.whl").write_bytes(b"")
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\n"
                    "case \"$*\" in\n"
                    "  *torch.cuda*) echo 'NVIDIA H100 80GB HBM3';;\n"
                    "  *executor.prewarm*) sleep ${SLEEP:-1}; echo 'prewarm: sampling: 1.0 s';;\n"
                    "  *-m\\ pytest*) sleep ${SLEEP:-1}; echo '3 passed in 1.00s';;\n"
                    "  *benchmarks/gpu.py*) echo '[decode] 1.9 ms/token';;\n"
                    "esac\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    common = ["--python", str(fake), "--wheelhouse", str(tmp_path / "wh")]
    report = tmp_path / "report"
    start = time.monotonic()
    assert gpu_session.main([*common, "--report", str(report), "--work",
                             str(tmp_path / "work"), "--deadline", "60"]) == 0
    assert time.monotonic() - start < 5  # phase 2 side by side: 1 s, not 6
    assert sorted(p.name for p in report.iterdir()) == ["gpu-run.tgz", "report.md"]
    text = (report / "report.md").read_text()
    for name in ("install", "prewarm:attention-256", "prewarm:lora", "test:first",
                 "test:rest", "bench"):
        assert f"| {name} | 0 |" in text
    assert "3 passed in 1.00s" in text and "[decode] 1.9 ms/token" in text
    with tarfile.open(report / "gpu-run.tgz") as tar:
        names = tar.getnames()
    assert {"install.log", "prewarm-sampling.log", "pytest-first.log", "pytest-rest.log",
            "bench.log"} <= set(names)
    capsys.readouterr()
    # Phase 2 takes 4 s and leaves less than the 5 s a phase needs: 3 and 4 never start.
    monkeypatch.setattr(gpu_session, "MIN_LEFT", 5)
    monkeypatch.setenv("SLEEP", "4")
    late = tmp_path / "late"
    assert gpu_session.main([*common, "--report", str(late), "--work", str(tmp_path / "w2"),
                             "--deadline", "8"]) == 1
    text = (late / "report.md").read_text()
    assert "| test:first | 0 |" in text and "test:rest" not in text and "| bench |" not in text
    with pytest.raises(SystemExit):
        gpu_session.main(["--wheelhouse", str(tmp_path / "none"), "--dry-run"])


# -- benchmarks/gpu.py ----------------------------------------------------------------------------

@pytest.mark.parametrize("key", ["1b", "8b"])
def test_hbm_bound_counts_every_weight_byte(key):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    name, shape, _ = bench.SHAPES[key]
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**shape))
    assert bench.weight_bytes(shape) == 2 * sum(p.numel() for p in model.parameters())
    # KV read per token at 1000 tokens of context: layers x (K, V) x heads x dim x bf16.
    kv = shape["num_hidden_layers"] * 2 * 1000 * shape["num_key_value_heads"] * \
        shape["head_dim"] * 2
    assert bench.kv_bytes_per_token(shape, 1000) == kv
    assert bench.hbm_bound(shape, 1000, 3e12) == pytest.approx(
        (bench.weight_bytes(shape) + kv) / 3e12)


def test_benchmark_recommends_the_await_mechanism_with_less_idle():
    assert bench.recommend_await({"thread": 3.0, "poll": 1.5}) == "poll"
    assert bench.recommend_await({"thread": 1.5, "poll": 3.0}) == "thread"
    assert bench.recommend_await({"poll": 2.0, "thread": 2.0}) == "thread"  # tie: the default


def test_benchmark_arguments_and_dry_run(capsys):
    args = bench.parse_args(["--only", "decode,idle", "--shapes", "8b", "--concurrency",
                             "1,8"])
    assert args.only == ["decode", "idle"] and args.shapes == ["8b"]
    assert args.concurrency == [1, 8] and args.await_mechanisms == ["thread", "poll"]
    for bad in (["--only", "speed"], ["--shapes", "70b"], ["--concurrency", "1,x"],
                ["--tokens", "8"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)
    capsys.readouterr()
    assert bench.main(["--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "Llama-3.2-1B shape: 2.47 GB" in out and "Llama-3.1-8B shape: 16.06 GB" in out
    assert "target >= 60%" in out and "target >= 80%" in out
    assert "thread, poll" in out and "concurrency 1, 32, 256" in out


def test_an_engine_is_built_only_after_the_previous_one_is_collected(monkeypatch):
    """The first GPU run: the idle part's engine, dropped but held in a reference cycle, still
    held 67 GiB when the throughput part's engine checked for free memory."""
    import gc
    import weakref

    import torch

    import asyncengine.config as config_module
    import asyncengine.engine.engine as engine_module

    alive: weakref.WeakSet = weakref.WeakSet()
    cleared = []

    class Engine:  # like the real one: reachable from itself, so refcounting cannot free it
        def __init__(self, config):
            assert not list(alive), "built while an earlier engine still holds the GPU"
            self.cycle = self
            alive.add(self)

    monkeypatch.setattr(engine_module, "AsyncEngine", Engine)
    monkeypatch.setattr(config_module.EngineConfig, "from_dict", staticmethod(lambda d: d))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: cleared.append(1))
    args = bench.parse_args([])

    def part() -> None:  # a part's engine, dropped when the part returns
        bench.make_engine(args, "model", max_num_seqs=4)

    gc.disable()  # as if no collection happened to run between the parts
    try:
        part()
        part()
    finally:
        gc.enable()
    assert len(cleared) == 2  # torch's cache emptied after each collection


def test_step_marks_measure_the_gpu_s_idle_between_steps(monkeypatch):
    """Batch-1 decode's verdict comes from the GPU's own idle time between steps (the first
    GPU run printed "does not bound" with a host of 1.36 ms per step against an HBM bound of
    0.82 ms), measured with events around each step's work."""
    import types

    import torch

    clock = [0.0]

    class Event:
        def __init__(self, enable_timing=False):
            self.t = None

        def record(self):
            self.t = clock[0]

        def elapsed_time(self, other):
            return other.t - self.t

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)

    def execute(inputs):  # 1 ms of GPU work per step, then 1.5 ms waiting for the host
        clock[0] += 1.0
        return "out"

    runner = types.SimpleNamespace(execute=execute)
    marks = bench.StepMarks(runner)
    for n in (7, 1, 1, 1, 1):  # a prefill, then four decode steps
        assert runner.execute(types.SimpleNamespace(num_tokens=n)) == "out"
        clock[0] += 1.5
    marks.restore()
    assert runner.execute is execute
    spans, gaps = marks.spans_and_gaps(1)
    assert spans == [1.0, 1.0, 1.0] and gaps == [1.5, 1.5, 1.5]
    assert bench.idle_percent(spans, gaps) == pytest.approx(60.0)
    assert bench.host_verdict(60.0) == "BOUNDS"
    assert bench.host_verdict(3.0) == "does not bound"


def test_host_profile_reports_the_loop_s_costliest_functions_per_step():
    def plan_step():  # stands in for the loop's work of one step
        return sum(i * i for i in range(2000))

    assert bench.parse_args(["--host-profile"]).host_profile
    assert bench.HostProfile(False).report(10) == []  # off: nothing, and no profiling
    profile = bench.HostProfile(True)
    with profile:
        for _ in range(10):
            plan_step()
    lines = profile.report(10, top=5)
    assert "10 steps" in lines[0] and len(lines) == 6
    row = next(line for line in lines[1:] if "plan_step (test_gpu_tools.py:" in line)
    own, cumulative, calls = row.split()[:3]
    assert float(calls) == 1.0 and float(cumulative) >= float(own) >= 0
