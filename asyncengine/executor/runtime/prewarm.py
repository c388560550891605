"""Compile FlashInfer's kernels ahead of time: ``python -m asyncengine.executor.runtime.prewarm``.

FlashInfer builds each kernel the first time it is used (nvcc, minutes) and keeps the build
in its disk cache (``~/.cache/flashinfer`` or ``FLASHINFER_CACHE_DIR``). The engine itself
compiles what it will run at start-up (``FlashInferBackend.prewarm`` and the sampling
prewarm, called by ``executor/build.py``), never on the loop at the first step; this command
fills the disk cache beforehand for a list of kernel specs, so that ``make gpu-check``'s tests
and benchmarks start in seconds and no test pays a compile inside its timeout.

A spec is what selects a distinct kernel: the head dim, whether decode uses tensor cores
(GQA groups larger than 4), and the layer variant (sliding window, soft cap); the number of
heads is a run-time parameter. The default list covers the GPU tests' models and
benchmarks/gpu.py's shapes. ``--dry-run`` prints the specs and exits (no CUDA needed).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch

from asyncengine.executor.attention.base import AttentionOptions


@dataclass(frozen=True)
class KernelSpec:
    head_dim: int
    tensor_cores: bool = False
    window: bool = False
    soft_cap: bool = False

    @property
    def options(self) -> AttentionOptions:
        return AttentionOptions(window=8 if self.window else None,
                                soft_cap=50.0 if self.soft_cap else None)

    @property
    def heads(self) -> tuple[int, int]:
        """(query heads, KV heads) with a GQA group that selects the decode kernel."""
        return (8, 1) if self.tensor_cores else (4, 2)

    def __str__(self) -> str:
        parts = [f"head_dim {self.head_dim}"]
        parts += [name for name, on in (("tensor-core decode", self.tensor_cores),
                                        ("window", self.window), ("soft cap", self.soft_cap))
                  if on]
        return ", ".join(parts)


#: The GPU tests' models (tests/gpu/test_gpu.py) and benchmarks/gpu.py's Llama shapes.
DEFAULT_SPECS = (
    KernelSpec(64),  # llama-hd64, qwen2-hd64, the embedded SmolLM2, Llama-3.2-1B's shape
    KernelSpec(64, window=True),  # windowed Mistral / Qwen2
    KernelSpec(128),  # llama-hd128, qwen3-hd128, Llama-3.1-8B's shape
    KernelSpec(128, tensor_cores=True),  # llama-gqa8-hd128 (a GQA group above 4)
    KernelSpec(256, window=True, soft_cap=True),  # Gemma 2's local layers
    KernelSpec(256, soft_cap=True),  # Gemma 2's global layers
)


#: What a prewarm compiles, in this order (``--parts``: separate processes can compile
#: separate parts side by side; one module's nvcc jobs use only a few cores). norm, rope and
#: activation are the decoder layer's fused ops (``kernels/cuda_layer_ops.py``).
LAYER_PARTS = ("norm", "rope", "activation")
PARTS = ("attention", "sampling", "lora", *LAYER_PARTS)


def prewarm_specs(specs: tuple[KernelSpec, ...] | list[KernelSpec], *, dtype: torch.dtype,
                  device: str = "cuda", graphs: bool = True, vocab_size: int = 49152,
                  module: Any = None, sampling_module: Any = None,
                  parts: tuple[str, ...] | list[str] = PARTS,
                  log: Any = print) -> dict[str, float]:
    """Compile and load every spec's prefill and decode kernels, then the sampling kernels,
    LoRA's segment GEMM and the layer ops (those of ``parts``); the seconds each took, by
    name. Raises what FlashInfer's JIT raises."""
    from asyncengine.executor.attention.flashinfer import FlashInferBackend
    from asyncengine.executor.sampler import flashinfer_sampling

    took: dict[str, float] = {}
    for spec in specs if "attention" in parts else ():
        heads, kv_heads = spec.heads
        backend = FlashInferBackend(heads, kv_heads, spec.head_dim, 16, dtype, device,
                                    max_pages_per_seq=2, module=module,
                                    workspace_bytes=16 << 20)
        backend.configure_layers([spec.options])
        took[str(spec)] = backend.prewarm(graphs=graphs)
        log(f"prewarm: attention {spec} ({dtype}): {took[str(spec)]:.1f} s")
    if "sampling" in parts:
        start = time.perf_counter()
        flashinfer_sampling.prewarm(device, vocab_size, module=sampling_module)
        took["sampling"] = time.perf_counter() - start
        log(f"prewarm: sampling: {took['sampling']:.1f} s")
    if "lora" in parts:
        from asyncengine.executor.lora import segment

        start = time.perf_counter()
        segment.prewarm(device, dtype, module=module)
        took["lora segment gemm"] = time.perf_counter() - start
        log(f"prewarm: LoRA segment GEMM ({dtype}): {took['lora segment gemm']:.1f} s")
    for part in (p for p in LAYER_PARTS if p in parts):
        from asyncengine.executor.kernels import cuda_layer_ops

        which = tuple(cuda_layer_ops.ACTIVATIONS) if part == "activation" else (part,)
        start = time.perf_counter()
        cuda_layer_ops.compile_ops(device, dtype, which, module=module)
        took[f"layer ops {part}"] = time.perf_counter() - start
        log(f"prewarm: layer ops, {part} ({dtype}): {took[f'layer ops {part}']:.1f} s")
    return took


def parse_specs(text: str) -> list[KernelSpec]:
    """``64,128+window,256+window+softcap,128+tc`` -> specs."""
    specs = []
    for item in text.split(","):
        head, *flags = item.strip().split("+")
        unknown = set(flags) - {"tc", "window", "softcap"}
        if not head.isdigit() or unknown:
            raise ValueError(f"--specs: cannot read {item!r} (HEAD_DIM[+tc][+window][+softcap])")
        specs.append(KernelSpec(int(head), "tc" in flags, "window" in flags, "softcap" in flags))
    return specs


def parse_parts(text: str) -> list[str]:
    parts = [p.strip() for p in text.split(",") if p.strip()]
    bad = [p for p in parts if p not in PARTS]
    if bad or not parts:
        raise argparse.ArgumentTypeError(f"--parts: {', '.join(bad) or 'nothing'} not in "
                                         f"{', '.join(PARTS)}")
    return parts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m asyncengine.executor.runtime.prewarm",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--specs", type=parse_specs, default=list(DEFAULT_SPECS),
                        help="HEAD_DIM[+tc][+window][+softcap],... (default: the GPU tests' "
                             "and benchmarks' kernels)")
    parser.add_argument("--parts", type=parse_parts, default=list(PARTS),
                        help=f"comma-separated, of {', '.join(PARTS)} (default: all)")
    parser.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    parser.add_argument("--no-graphs", action="store_true",
                        help="skip the CUDA-graph-mode decode wrappers")
    parser.add_argument("--dry-run", action="store_true", help="print the specs and exit")
    parser.add_argument("--json", help="write the seconds per spec to this file")
    try:
        args = parser.parse_args(argv)
    except ValueError as e:
        parser.error(str(e))
    if args.dry_run:
        for spec in args.specs if "attention" in args.parts else ():
            print(f"would compile: attention {spec} ({args.dtype})")
        if "sampling" in args.parts:
            print("would compile: sampling")
        if "lora" in args.parts:
            print(f"would compile: LoRA segment GEMM ({args.dtype})")
        for part in (p for p in LAYER_PARTS if p in args.parts):
            print(f"would compile: layer ops, {part} ({args.dtype})")
        return 0
    if not torch.cuda.is_available():
        print("prewarm needs a CUDA GPU (FlashInfer compiles for the device it runs on)",
              file=sys.stderr)
        return 2
    from asyncengine.executor.attention.flashinfer import flashinfer_import_error

    error = flashinfer_import_error()
    if error is not None:
        print(f"prewarm: the flashinfer package is unusable: {error}", file=sys.stderr)
        return 1
    took = prewarm_specs(args.specs, dtype=getattr(torch, args.dtype),
                         graphs=not args.no_graphs, parts=args.parts)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(took, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
