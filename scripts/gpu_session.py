"""``make gpu-session``: the GPU check in one device command of about nine minutes, for a
lease of 15 minutes of device time (docs/gpu.md, "Running it on a GPU").

The first run on a GPU (an H100, 2026-11-27) showed where the time goes:
- FlashInfer's JIT: attention takes 41-95 s per head dim and variant, sampling 96 s and
  LoRA's GEMM 83 s. Compiled one after another in one prewarm, that was 230 s.
- One module's nvcc jobs use few of the machine's 16 cores.
- A test that waits for no kernel runs in seconds.

So the session runs these phases. A phase's steps run side by side, and all phases share one
deadline:

1. install;
2. prewarm, one process per part, beside the tests that need no attention kernel (float32,
   events, seeded sampling; these wait on the lock of the sampling kernels):
   - attention at head dims 64 and 128 (and 128's tensor-core decode);
   - 64 with a window;
   - Gemma 2's two variants at 256;
   - sampling;
   - LoRA;
   - the layer ops (norm; RoPE and the activations);
3. the other GPU tests;
4. benchmarks/gpu.py alone on the GPU, with ``--host-profile``:
   - batch-1 decode (1B, 8B), with the fused layer ops and without;
   - idle at 256 streams (the default waiter thread only: it beat polling by 7 points);
   - throughput.

Every step's timeout is cut to what is left of ``--deadline``. The logs go to a work folder.
Two files go to the report folder: ``report.md`` and ``gpu-run.tgz`` (every log and JSON),
which is within what the device tool brings back. ``--dry-run`` prints the phases.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import tarfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_check  # noqa: E402

FIRST_TESTS = "float32 or events or seeded"
PREWARMS = {"attention-64-128": ["--parts", "attention", "--specs", "64,128,128+tc"],
            "attention-64-window": ["--parts", "attention", "--specs", "64+window"],
            "attention-256": ["--parts", "attention", "--specs", "256+window+softcap,256+softcap"],
            "sampling": ["--parts", "sampling"],
            "lora": ["--parts", "lora"],
            "layer-norm": ["--parts", "norm"],
            "layer-rope-act": ["--parts", "rope,activation"]}
#: A phase starts only with at least this many seconds left before the deadline.
MIN_LEFT = 10
BENCH_ARGS = ["--only", "decode,idle,throughput", "--shapes", "1b,8b", "--tokens", "64",
              "--await-mechanisms", "thread", "--layer-ops", "fused,pytorch", "--host-profile",
              "--profiler"]


def phases(args: argparse.Namespace, work: Path) -> list[list[gpu_check.Step]]:
    py = args.python
    wheels = sorted(str(p) for p in Path(args.wheelhouse).glob("*.whl"))

    def pytest(name: str, expression: str) -> gpu_check.Step:
        return gpu_check.Step(f"test:{name}", [
            py, "-m", "pytest", "-m", "gpu", "-rs", "-q", "-p", "no:cacheprovider",
            "--durations=15", "--tb=short", *gpu_check.gpu_test_files(), "-k", expression],
            f"pytest-{name}.log", 0)

    install = gpu_check.Step("install", [
        py, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
        "--disable-pip-version-check", "--upgrade", "--target", args.site, *wheels],
        "install.log", 0)
    prewarms = [gpu_check.Step(f"prewarm:{name}", [
        py, "-m", "asyncengine.executor.runtime.prewarm", "--json",
        str(work / f"prewarm-{name}.json"),
        *extra], f"prewarm-{name}.log", 0) for name, extra in PREWARMS.items()]
    bench = gpu_check.Step("bench", [py, "benchmarks/gpu.py", "--json",
                                     str(work / "bench.json"), *BENCH_ARGS,
                                     *shlex.split(args.bench_args)], "bench.log", 0)
    return [[install], [*prewarms, pytest("first", FIRST_TESTS)],
            [pytest("rest", f"not ({FIRST_TESTS})")], [bench]]


def pack(work: Path, report: Path) -> None:
    with tarfile.open(report / "gpu-run.tgz", "w:gz") as tar:
        for path in sorted(work.iterdir()):
            tar.add(path, arcname=path.name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--report", default=str(gpu_check.ROOT / ".gpu-report"))
    parser.add_argument("--work", default="/tmp/asyncengine-gpu-session",
                        help="where the logs are written before they are packed")
    parser.add_argument("--wheelhouse", default=str(gpu_check.ROOT / ".gpu-wheelhouse"))
    parser.add_argument("--site", default="/tmp/asyncengine-site")
    parser.add_argument("--python", default=sys.executable)
    parser.add_argument("--deadline", type=int, default=540,
                        help="seconds from the start by which every step has ended")
    parser.add_argument("--bench-args", default="", help="more benchmarks/gpu.py arguments")
    parser.add_argument("--dry-run", action="store_true", help="print the phases only")
    args = parser.parse_args(argv)
    if not list(Path(args.wheelhouse).glob("*.whl")):
        parser.error(f"--wheelhouse: no wheels in {args.wheelhouse} (run `make "
                     "gpu-wheelhouse` where the registries are reachable, and carry the folder)")
    work, report = Path(args.work), Path(args.report)
    plan = phases(args, work)
    if args.dry_run:
        for i, phase in enumerate(plan, 1):
            for step in phase:
                print(f"[{i}] {step.name}: {shlex.join(step.argv)}")
        return 0
    work.mkdir(parents=True, exist_ok=True)
    report.mkdir(parents=True, exist_ok=True)
    env = gpu_check.environment(args)
    start = time.monotonic()
    device = gpu_check.device_line(args.python)
    done: list[gpu_check.Step] = []
    for phase in plan:
        left = int(args.deadline - (time.monotonic() - start))
        if left < MIN_LEFT:
            break
        for step in phase:
            step.timeout = left
        threads = [threading.Thread(target=gpu_check.run, args=(step, work, env))
                   for step in phase]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        done += phase
        print(" | ".join(f"{s.name}: exit {s.rc} in {s.seconds:.0f} s" for s in phase),
              flush=True)
        gpu_check.write_report(report, done, device)
        if phase[0].name == "install" and phase[0].rc != 0:
            break
    pack(work, report)
    print((report / "report.md").read_text())
    return 0 if all(s.rc == 0 for s in done) and len(done) == sum(map(len, plan)) else 1


if __name__ == "__main__":
    sys.exit(main())
