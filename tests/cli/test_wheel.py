"""The built wheel, installed into a fresh virtual environment, serves a request: the package
is complete without the checkout (the C++ kernel sources come with it as asyncengine/_kernels,
the web UI's files as asyncengine/_http), and a scheduler distribution from schedulers/,
installed next to it, is found through its entry point and schedules that request.

torch and the other dependencies are reused from the test environment (the new environment
sees them through a .pth file); asyncengine itself comes from the wheel only (--no-deps).
"""

from __future__ import annotations

import json
import os
import shutil
import site
import socket
import subprocess
import sys
import time
import urllib.request
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SPF = REPO / "schedulers" / "shortest_prompt_first"
ENGINE_FLAGS = ["--dtype", "float32", "--block-size", "8", "--num-gpu-blocks-override", "64",
                "--max-model-len", "128", "--max-num-seqs", "4"]


def run(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(args, check=True, capture_output=True, text=True, timeout=300, **kw)


@pytest.fixture(scope="module")
def wheel_env(tmp_path_factory) -> tuple[Path, Path]:
    """(the new environment's python, the built wheel)."""
    root = tmp_path_factory.mktemp("wheel")
    source = root / "src"  # a copy: building writes build/ and *.egg-info next to the sources
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache",
        "tests", "benchmarks", "docs"))
    run(sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
        "--wheel-dir", str(root / "dist"), str(source), str(source / SPF.relative_to(REPO)))
    wheel = next((root / "dist").glob("asyncengine-*.whl"))
    venv = root / "venv"
    run(sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv))
    python = venv / "bin" / "python"
    # --system-site-packages shows the base interpreter's packages, not the test
    # environment's (torch, transformers, ...): add those, after the venv's own.
    purelib = run(str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"
                  ).stdout.strip()
    # The test environment's own editable asyncengine (a meta-path finder that a .pth file
    # installs) is left out, so that nothing but the wheel can provide the package.
    dirs = [d for d in site.getsitepackages() if Path(d).is_dir()]
    Path(purelib, "_outer_env.py").write_text(
        "import os, site, sys\n"
        f"for d in {dirs!r}:\n"
        "    if d not in sys.path:\n"
        "        sys.path.append(d)\n"
        "    for name in sorted(os.listdir(d)):\n"
        "        if name.endswith('.pth') and not name.startswith(\n"
        "                ('__editable__.asyncengine-', '__editable__.asyncengine_spf-')):\n"
        "            site.addpackage(d, name, None)\n"
        # nor a path entry for the checkout itself (a .pth file of some other install)
        f"sys.path[:] = [p for p in sys.path if os.path.realpath(p) != {str(REPO)!r}]\n")
    Path(purelib, "_outer_env.pth").write_text("import _outer_env\n")
    # --ignore-installed: the test environment's asyncengine 0.1.0 is visible from the new one,
    # and pip would otherwise take it for this wheel, already installed.
    run(sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet", "--no-deps",
        "--no-index", "--ignore-installed", str(wheel),
        *map(str, (root / "dist").glob("asyncengine_spf-*.whl")))
    if not (Path(purelib) / "asyncengine" / "plugins.py").is_file():
        raise RuntimeError(f"the wheel was not installed into {purelib}")
    return python, wheel


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as response:
        return json.loads(response.read())


def test_the_wheel_serves_a_request_from_a_fresh_environment(wheel_env, tiny_llama, tmp_path):
    python, wheel = wheel_env
    names = zipfile.ZipFile(wheel).namelist()
    assert "asyncengine/plugins.py" in names
    assert any(n.startswith("asyncengine/_kernels/") and n.endswith(".cpp") for n in names)
    assert not any(n.startswith(("tests/", "schedulers/", "plugins/", "kernels/")) for n in names)

    # Run away from the checkout, so nothing can be imported from it.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}
    env["ASYNCENGINE_PLUGINS"] = "spf"
    where = run(str(python), "-c", "import asyncengine, asyncengine.plugins as p, "
                "importlib.metadata as m; print(asyncengine.__file__); "
                "print(sorted(e.name for e in m.entry_points(group='asyncengine')))",
                cwd=tmp_path, env=env).stdout.splitlines()
    assert str(python.parents[1]) in where[0], where  # the wheel's copy, not the checkout's
    assert "'builtins'" in where[1] and "'spf'" in where[1]

    port = free_port()
    log = tmp_path / "server.log"
    with open(log, "wb") as out:
        server = subprocess.Popen(
            [str(python), "-m", "asyncengine", "serve", tiny_llama, "--port", str(port),
             "--scheduler", "spf", *ENGINE_FLAGS], cwd=tmp_path, env=env, stdout=out,
            stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert server.poll() is None, f"the server exited:\n{log.read_text()}"
            assert time.monotonic() < deadline, f"no /health after 120 s:\n{log.read_text()}"
            try:
                urllib.request.urlopen(f"{base}/health", timeout=2).close()
                break
            except OSError:
                time.sleep(0.2)
        with urllib.request.urlopen(f"{base}/v1/models", timeout=30) as response:
            (model,) = json.loads(response.read())["data"]
        reply = post(f"{base}/v1/completions", {
            "model": model["id"], "prompt": "The capital of France is",
            "max_tokens": 5, "temperature": 0, "ignore_eos": True})
        (choice,) = reply["choices"]
        assert choice["finish_reason"] == "length" and choice["text"]
        assert reply["usage"]["completion_tokens"] == 5
    finally:
        server.terminate()
        server.wait(timeout=30)
    # --scheduler spf resolved: the installed distribution's entry point was loaded.
    assert "not registered" not in log.read_text()
