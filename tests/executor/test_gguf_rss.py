"""Loading a GGUF file kept packed makes no float copy of its weights, not even transiently:
the peak RSS of a process loading it grows by at most 1.2x the file's size (the test
builds the model's skeleton first: its RoPE tables and imports are the baseline)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.executor.test_kquants import write_mixed_gguf

# Peak RSS as VmHWM (this process's own memory map's high-water mark): ru_maxrss would carry
# the parent's peak across fork and exec.
_CHILD = r"""
import json, sys
def peak():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM"))
import torch, gguf, gguf.quants
from asyncengine.executor.models import decoder, llama
from asyncengine.executor.weights import kquants
from asyncengine.executor.weights import gguf as gguf_mod
from asyncengine.executor.weights.loader import load_model, resolve_model
assert kquants.kernels_available()
source = resolve_model(sys.argv[1])
torch.ones(1024) @ torch.ones(1024)  # the thread pool up
# the baseline: modules imported and tables built by the model's skeleton (its float weights
# are allocated, never written: untouched pages are not resident)
from asyncengine.executor.models.registry import BUILTIN_MODELS, architecture_of
del BUILTIN_MODELS[architecture_of(source.hf_config)](source.hf_config).model
before = peak()
model = load_model(source, "auto", torch.float32, "cpu", quantization="auto")
packed = peak()
floats = load_model(source, "auto", torch.float32, "cpu", quantization="none")
dequantized = peak()
print(json.dumps({"packed": (packed - before) * 1024, "none": (dequantized - packed) * 1024}))
"""


def peak_growth(path: str) -> dict[str, int]:
    """Bytes the peak RSS of a fresh process grows by while loading ``path`` packed
    (``--quantization auto``), then again dequantized (``none``)."""
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": root}
    out = subprocess.run([sys.executable, "-c", _CHILD, path], env=env,
                         capture_output=True, text=True, timeout=300, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_loading_packed_peaks_under_1_2x_the_file(tmp_path):
    path = write_mixed_gguf(str(tmp_path / "tiny-Q4_K_M.gguf"))
    size = os.path.getsize(path)
    growth = peak_growth(path)
    assert growth["packed"] <= 1.2 * size, (
        f"peak RSS grew {growth['packed'] / 2**20:.1f} MB, file {size / 2**20:.1f} MB")
    # and the measure sees a float copy: dequantized, the same file costs ~4x its size
    assert growth["none"] > 2 * size, growth
