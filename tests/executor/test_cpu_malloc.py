"""On glibc the CPU device keeps a step's large buffers in the heap between steps
(``executor/runtime/cpu_malloc.py``): allocating the same 19 MB every step faults no pages
back in."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

_CHILD = r"""
import resource, sys, torch
if sys.argv[1] == "tuned":
    from asyncengine.executor.runtime.cpu_malloc import keep_step_buffers
    assert keep_step_buffers()
def step():
    logits = torch.empty(32, 151936)  # a 32-row batch's float32 logits
    logits.fill_(1.0)
    return logits.to(torch.bfloat16).float().sum().item()
step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def faults(mode: str) -> int:
    root = str(Path(__file__).resolve().parents[2])
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    env.update(PYTHONPATH=root, OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", _CHILD, mode], env=env, capture_output=True,
                         text=True, timeout=120, check=True)
    return int(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                    reason="glibc's malloc only")
def test_step_buffers_stay_mapped_between_steps():
    pages = 20 * 3 * 19_447_808 // 4096  # 20 steps of 3 buffers, every page faulted again
    tuned = faults("tuned")
    assert tuned < pages // 50
    # glibc's own dynamic threshold saves some of them, depending on the order of frees
    assert faults("default") > 4 * tuned
