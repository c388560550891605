"""The device named by ``--device``: ``auto`` (CUDA when there is one), ``cuda``, ``cpu``."""

from __future__ import annotations

from asyncengine.executor.runtime.cuda_device import CUDADevice
from asyncengine.executor.runtime.device import CPUDevice, Device


def make_device(device: str, num_threads: int | None = None) -> Device:
    """The device for ``--device`` (``--threads``: the CPU's OpenMP team)."""
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ValueError("--device cuda: no CUDA device is available (use --device cpu)")
        return CUDADevice()
    return CPUDevice(num_threads)
