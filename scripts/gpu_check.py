"""``make gpu-check``: the whole GPU run on a machine with no package index, in one command.

Steps (``--steps``, in this order; each one's output goes to the report folder as it runs, so
a run cut short still brings back what it did):

1. ``install``: ``pip install --no-index --no-deps --target SITE`` of ``.gpu-wheelhouse/*.whl``
   (``make gpu-wheelhouse`` builds it where the registries are reachable); SITE goes first on
   ``PYTHONPATH`` for every later step, with the checkout itself (asyncengine runs from the
   source tree), and ``ASYNCENGINE_TEST_TOKENIZER_DIR`` names the wheelhouse's tokenizer.
2. ``prewarm``: ``python -m asyncengine.executor.runtime.prewarm``: FlashInfer's JIT compiles the
   kernels of the GPU tests and benchmarks into its disk cache before anything is timed.
3. ``test``: ``pytest -m gpu -rs`` over the test files that carry the ``gpu`` marker.
4. ``bench``: ``benchmarks/gpu.py --json``: every figure of issue 25's part 2.

Then ``report.md`` in the report folder: the device, each step's exit status and duration,
pytest's summary line and skips, the benchmark's printout. ``--dry-run`` prints the commands
and runs nothing (a CPU test checks them). Exit status: 0 when every step passed.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STEPS = ("install", "prewarm", "test", "bench")
#: Seconds each step may take by default (the device lends at most 10 minutes a command:
#: run the steps as separate commands there, see docs/gpu.md; ``--timeouts`` overrides).
TIMEOUTS = {"install": 120, "prewarm": 540, "test": 570, "bench": 570}


@dataclass
class Step:
    name: str
    argv: list[str]
    log: str
    timeout: int
    rc: int | None = None
    seconds: float = 0.0
    tail: list[str] = field(default_factory=list)


def gpu_test_files(root: Path = ROOT) -> list[str]:
    """The test files that mark tests ``gpu`` (``pytestmark`` or a decorator)."""
    return sorted(str(p.relative_to(root)) for p in (root / "tests").rglob("test_*.py")
                  if re.search(r"pytest\.mark\.gpu\b", p.read_text(errors="replace")))


def plan(args: argparse.Namespace) -> list[Step]:
    py = args.python
    wheels = sorted(str(p) for p in Path(args.wheelhouse).glob("*.whl"))
    steps = {
        "install": Step("install", [py, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                                    "--no-compile", "--disable-pip-version-check", "--upgrade",
                                    "--target", args.site, *wheels], "install.log",
                        TIMEOUTS["install"]),
        "prewarm": Step("prewarm", [py, "-m", "asyncengine.executor.runtime.prewarm", "--json",
                                    str(Path(args.report) / "prewarm.json"),
                                    *(["--specs", args.prewarm_specs]
                                      if args.prewarm_specs else [])],
                        "prewarm.log", TIMEOUTS["prewarm"]),
        "test": Step("test", [py, "-m", "pytest", "-m", "gpu", "-rs", "-q", "-p",
                              "no:cacheprovider", "--durations=15", *gpu_test_files(),
                              *shlex.split(args.pytest_args)], "pytest.log",
                     TIMEOUTS["test"]),
        "bench": Step("bench", [py, "benchmarks/gpu.py", "--json",
                                str(Path(args.report) / "bench.json"),
                                *shlex.split(args.bench_args)], "bench.log",
                      TIMEOUTS["bench"]),
    }
    return [steps[name] for name in args.steps]


def environment(args: argparse.Namespace) -> dict[str, str]:
    env = dict(os.environ)
    paths = [args.site, str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(":") if p]
    env["PYTHONPATH"] = ":".join(paths)
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("MAX_JOBS", str(os.cpu_count() or 8))  # FlashInfer's parallel nvcc jobs
    tokenizer = Path(args.wheelhouse) / "tokenizer"
    if tokenizer.is_dir():
        env.setdefault("ASYNCENGINE_TEST_TOKENIZER_DIR", str(tokenizer.resolve()))
    env.setdefault("HF_HUB_OFFLINE", "1")
    return env


def run(step: Step, report: Path, env: dict[str, str]) -> None:
    start = time.perf_counter()
    with open(report / step.log, "w") as log:
        log.write("$ " + shlex.join(step.argv) + "\n")
        log.flush()
        try:
            step.rc = subprocess.run(step.argv, cwd=ROOT, env=env, stdout=log,
                                     stderr=subprocess.STDOUT, timeout=step.timeout).returncode
        except subprocess.TimeoutExpired:
            step.rc = 124
            log.write(f"\n[gpu-check] {step.name}: stopped after {step.timeout} s\n")
    step.seconds = time.perf_counter() - start
    step.tail = (report / step.log).read_text(errors="replace").splitlines()[-40:]


def summary_lines(step: Step) -> list[str]:
    """What the report keeps of a step: pytest's skips, failures and summary; all of the
    benchmark; the last lines otherwise. (``make gpu-session`` names its steps
    ``test:first``, ``prewarm:sampling``, ...: the part before the colon is the kind.)"""
    kind = step.name.split(":")[0]
    if kind == "test":
        keep = [line for line in step.tail if re.match(
            r"(SKIPPED|FAILED|ERROR|XFAIL|\d+ (passed|failed)|=+ .*(passed|failed|error))",
            line)]
        return keep or step.tail[-10:]
    if kind == "bench":
        return step.tail
    return step.tail[-8:]


def device_line(python: str) -> str:
    code = ("import torch; print(torch.__version__, torch.version.cuda, "
            "torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA device')")
    try:
        return subprocess.run([python, "-c", code], capture_output=True, text=True,
                              timeout=120).stdout.strip()
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unknown ({e})"


def write_report(report: Path, steps: list[Step], device: str) -> None:
    lines = ["# make gpu-check", "", f"device: {device}", "",
             "| step | exit | seconds |", "|---|---|---|"]
    lines += [f"| {s.name} | {s.rc} | {s.seconds:.0f} |" for s in steps]
    for s in steps:
        lines += ["", f"## {s.name} ({s.log})", "", "```", *summary_lines(s), "```"]
    (report / "report.md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", default=",".join(STEPS),
                        help=f"comma-separated, of {', '.join(STEPS)}")
    parser.add_argument("--report", default=str(ROOT / ".gpu-report"),
                        help="folder of report.md and the logs (make gpu-check REPORT=$OUT)")
    parser.add_argument("--wheelhouse", default=str(ROOT / ".gpu-wheelhouse"))
    parser.add_argument("--site", default="/tmp/asyncengine-site",
                        help="where the wheels are installed (first on PYTHONPATH)")
    parser.add_argument("--python", default=sys.executable)
    parser.add_argument("--prewarm-specs", default="", help="passed to the prewarm's --specs")
    parser.add_argument("--pytest-args", default="", help="more pytest arguments")
    parser.add_argument("--bench-args", default="", help="more benchmarks/gpu.py arguments")
    parser.add_argument("--timeouts", default="",
                        help="seconds per step, e.g. prewarm=900,test=1200")
    parser.add_argument("--dry-run", action="store_true", help="print the commands only")
    args = parser.parse_args(argv)
    try:
        timeouts = dict(TIMEOUTS)
        for item in filter(None, args.timeouts.split(",")):
            name, _, seconds = item.partition("=")
            if name not in TIMEOUTS:
                raise ValueError(name)
            timeouts[name] = int(seconds)
    except ValueError:
        parser.error(f"--timeouts: cannot read {args.timeouts!r} (STEP=SECONDS,...)")
    args.steps = [s.strip() for s in args.steps.split(",") if s.strip()]
    unknown = [s for s in args.steps if s not in STEPS]
    if unknown or not args.steps:
        parser.error(f"--steps: {', '.join(unknown) or 'nothing'} not in {', '.join(STEPS)}")
    if "install" in args.steps and not list(Path(args.wheelhouse).glob("*.whl")):
        parser.error(f"--steps install: no wheels in {args.wheelhouse} (run `make "
                     "gpu-wheelhouse` where the registries are reachable, and carry the folder)")
    steps = plan(args)
    for step in steps:
        step.timeout = timeouts[step.name]
    env = environment(args)
    if args.dry_run:
        print(f"PYTHONPATH={env['PYTHONPATH']}")
        for step in steps:
            print(f"[{step.name}] {shlex.join(step.argv)}  (timeout {step.timeout} s)")
        return 0
    report = Path(args.report)
    report.mkdir(parents=True, exist_ok=True)
    device = device_line(args.python)
    for step in steps:
        print(f"[gpu-check] {step.name} ...", flush=True)
        run(step, report, env)
        print(f"[gpu-check] {step.name}: exit {step.rc} in {step.seconds:.0f} s", flush=True)
        write_report(report, steps, device)
        if step.name == "install" and step.rc != 0:
            break  # nothing after it can run
    print((report / "report.md").read_text())
    return 0 if all(s.rc == 0 for s in steps) else 1


if __name__ == "__main__":
    sys.exit(main())
