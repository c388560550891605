"""``make gpu-wheelhouse``: what a GPU machine with no package index needs, in one folder.

The device image (Python 3.12, torch 2.11 + CUDA 13, transformers 5, nvcc, pytest, aiohttp,
...) lacks some of asyncengine's dependencies, and at most ~64 MiB of ignored files travel to
it. This script, run where the registries are reachable, fills ``.gpu-wheelhouse/`` (ignored
by git) with:

* wheels for Python 3.12 / manylinux x86_64 of every package in ``DEVICE_LACKS``, at the
  versions installed here (the versions the test suite passes with), checked for completeness:
  a requirement of theirs that is neither on the device (``DEVICE_HAS``) nor in the folder
  stops the script;
* ``flashinfer-python==0.7.2.post1`` trimmed (62 MB as published): of its kernel sources
  (``data/csrc``) only those of the kernels asyncengine compiles (FA2 batch prefill, batch
  decode, sampling, top-k, the segment GEMM of LoRA, norm and RoPE), and none of the
  vendored libraries' examples, tests and Python bindings; the wheel's RECORD is rewritten to match;
* ``tokenizer/``: the embedded model's tokenizer (the GPU tests' tiny models use it; the
  93 MB embedded model itself does not travel);
* ``MANIFEST.txt``: every file and its size.

The total must stay under ``LIMIT`` bytes (60 MB). ``--dry-run`` prints the plan and
downloads nothing. The device side is ``scripts/gpu_check.py`` (``make gpu-check``).
Needs Python 3.11+ (tomllib).
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import importlib.metadata
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / ".gpu-wheelhouse"
LIMIT = 60_000_000
FLASHINFER = "flashinfer-python==0.7.2.post1"

#: Runtime dependencies (and theirs) the device image lacks; versions: as installed here.
DEVICE_LACKS = ("msgspec", "xgrammar", "gguf", "aiohttp-cors", "apache-tvm-ffi", "pydantic",
                "pydantic-core", "annotated-types", "typing-inspection",
                # on the device, at a version unknown here; pydantic-core needs >= 4.14.1
                "typing-extensions",
                # for the tests: tests/gpu/test_gpu_lora.py compares with PEFT (pure Python)
                "peft")
#: What the device image has (docs of the lent machines, 2026-11), as normalized names.
DEVICE_HAS = frozenset("""
aiohttp aiosignal anyio attrs certifi charset-normalizer click cuda-bindings cuda-core
cuda-pathfinder einops filelock frozenlist fsspec h11 hf-xet httpcore httpx huggingface-hub
hypothesis idna iniconfig jinja2 markupsafe multidict ninja numpy nvidia-ml-py packaging pillow
pip pluggy prometheus-client propcache psutil pytest pytest-timeout pyyaml regex requests
safetensors sentencepiece setuptools tabulate tokenizers torch tqdm transformers triton
typing-extensions urllib3 uvloop wheel yarl accelerate
""".split())
PLATFORM_ARGS = ["--python-version", "3.12", "--implementation", "cp", "--only-binary",
                 ":all:"] + [a for p in ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64",
                                         "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
                                         "manylinux2014_x86_64", "manylinux1_x86_64")
                             for a in ("--platform", p)]

#: flashinfer/data/csrc files kept: the JIT sources of the kernels asyncengine compiles.
KEEP_CSRC = re.compile(r"^(batch_prefill|batch_decode(?!_mla)|sampling|renorm|"
                       r"flashinfer_sampling|topk|flashinfer_topk|cub_topk|"
                       # LoRA's segment GEMM: the sm80 module (with bmm_fp8) and the sm90 one
                       r"group_gemm(\.cu|_sm90)|bmm_fp8\.cu|flashinfer_gemm_(sm90_)?binding|"
                       # the fused layer ops (the activations' sources are generated)
                       r"(flashinfer_)?(norm|rope)(\.cu|_binding))"
                       r"|\.(h|cuh)$")
#: Paths (inside the wheel) dropped: vendored libraries' extras, experimental kernel sources.
DROP = re.compile(r"^flashinfer/data/(cutlass/(examples|python|test|media|docs)/|"
                  r"cutlass/tools/(?!util/)|cccl/(python|ci)/)"
                  r"|^flashinfer/experimental/.*/(?!.*\.py$)[^/]+$|/__pycache__/")


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def keep_in_flashinfer(path: str) -> bool:
    """Whether the trimmed FlashInfer wheel keeps ``path`` (a name inside the wheel)."""
    if path.startswith("flashinfer/data/csrc/"):
        rest = path[len("flashinfer/data/csrc/"):]
        return "/" not in rest and bool(KEEP_CSRC.search(rest))
    return not DROP.search(path)


def trim_wheel(src: Path, dest: Path, keep=keep_in_flashinfer) -> tuple[int, int]:
    """Copy the wheel ``src`` to ``dest`` with only the files ``keep`` accepts; RECORD
    rewritten (hashes and sizes of what is left). Returns (files kept, files dropped)."""
    kept = dropped = 0
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dest, "w", zipfile.ZIP_DEFLATED,
                                                      compresslevel=9) as zout:
        record_name = next(n for n in zin.namelist() if n.endswith(".dist-info/RECORD"))
        rows = []
        for info in zin.infolist():
            name = info.filename
            if name == record_name or name.endswith("/"):
                continue
            if not keep(name):
                dropped += 1
                continue
            data = zin.read(name)
            zout.writestr(info, data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
            rows.append(f"{name},sha256={digest.decode()},{len(data)}")
            kept += 1
        rows.append(f"{record_name},,")
        zout.writestr(record_name, "\n".join(rows) + "\n")
    return kept, dropped


def requirements(wheel: Path) -> set[str]:
    """The normalized names a wheel requires (no extras, markers for Linux x86_64 / 3.12)."""
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(meta).decode()
    out = set()
    for line in text.splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        req, _, marker = line[len("Requires-Dist:"):].partition(";")
        if "extra" in marker or "python_version < '3.9'" in marker:
            continue
        out.add(normalize(re.split(r"[\s<>=!~(\[]", req.strip(), maxsplit=1)[0]))
    return out


def runtime_dependencies(pyproject: Path = ROOT / "pyproject.toml") -> set[str]:
    """The normalized names of asyncengine's runtime dependencies (``[project]
    dependencies``)."""
    import tomllib

    deps = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    return {normalize(re.split(r"[\s<>=!~(\[;]", d.strip(), maxsplit=1)[0]) for d in deps}


def uncovered(pyproject: Path = ROOT / "pyproject.toml") -> set[str]:
    """Runtime dependencies neither on the device image nor in ``DEVICE_LACKS``: a new one
    must be added to one of them (the wheelhouse would miss it)."""
    return runtime_dependencies(pyproject) - DEVICE_HAS - {normalize(n) for n in DEVICE_LACKS}


def pins() -> list[str]:
    out = []
    for name in DEVICE_LACKS:
        try:
            out.append(f"{name}=={importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            out.append(name)
    return out


def download(specs: list[str], dest: Path) -> None:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           "-q", "-d", str(dest), *PLATFORM_ARGS, *specs]
    subprocess.run(cmd, check=True)


def wheel_name(path: Path) -> str:
    return normalize(path.name.split("-")[0])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--dry-run", action="store_true", help="print the plan, fetch nothing")
    args = parser.parse_args(argv)
    if missing := uncovered():
        print(f"runtime dependencies the device image may lack, not in DEVICE_LACKS: "
              f"{', '.join(sorted(missing))}", file=sys.stderr)
        return 1
    specs = pins()
    if args.dry_run:
        print(f"would download to {args.out}: {' '.join(specs)}")
        print(f"would trim: {FLASHINFER} (kernel sources kept: {KEEP_CSRC.pattern})")
        print("would copy: the embedded model's tokenizer to tokenizer/")
        return 0
    out: Path = args.out
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    download(specs, out)
    with tempfile.TemporaryDirectory() as tmp:
        download([FLASHINFER], Path(tmp))
        (src,) = Path(tmp).glob("flashinfer_python-*.whl")
        kept, dropped = trim_wheel(src, out / src.name)
        print(f"flashinfer: {src.stat().st_size / 1e6:.1f} MB -> "
              f"{(out / src.name).stat().st_size / 1e6:.1f} MB ({kept} files kept, "
              f"{dropped} dropped)")
    wheels = sorted(out.glob("*.whl"))
    have = {wheel_name(w) for w in wheels} | DEVICE_HAS
    missing = {f"{wheel_name(w)} needs {r}" for w in wheels for r in requirements(w)
               if r not in have and not (wheel_name(w) == "flashinfer-python" and r in
                                         FLASHINFER_LAZY_DEPS)}
    if missing:
        print("the wheelhouse is incomplete: " + "; ".join(sorted(missing)), file=sys.stderr)
        return 1
    sys.path.insert(0, str(ROOT))
    from tests.utils import embedded_tokenizer_dir

    shutil.copytree(embedded_tokenizer_dir(), out / "tokenizer")
    files = sorted(p for p in out.rglob("*") if p.is_file())
    total = sum(p.stat().st_size for p in files)
    lines = [f"{p.stat().st_size:>10}  {p.relative_to(out)}" for p in files]
    (out / "MANIFEST.txt").write_text("\n".join(lines) + f"\n{total:>10}  total\n")
    print("\n".join(lines) + f"\n{total / 1e6:.1f} MB in {out}")
    if total > LIMIT:
        print(f"over the {LIMIT / 1e6:.0f} MB limit", file=sys.stderr)
        return 1
    return 0


#: FlashInfer's requirements that ``import flashinfer`` and the JIT of prefill/decode/sampling
#: do not use (CuTe DSL, cuDNN and NCCL paths; the device has cuda-bindings, not the
#: cuda-python meta package): not carried.
FLASHINFER_LAZY_DEPS = frozenset({"cuda-python", "cuda-tile", "nccl-extensions", "nccl4py",
                                  "nvidia-cudnn-frontend", "nvidia-cutlass-dsl"})

if __name__ == "__main__":
    sys.exit(main())
