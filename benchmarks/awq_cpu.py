"""An AWQ checkpoint on the CPU: int4 on its own grid (``--quantization auto``, the default)
against the same checkpoint dequantized at load (``--quantization none``), in one run.

The checkpoint is made here from the embedded SmolLM2-135M: its HF copy
(``benchmarks/hf_copy.py``) quantized as AutoAWQ stores it (4 bits, zero points, groups of 64
inputs: 576 is not a multiple of 128), so that both sides load the very same file. Printed per
side: the weights' bytes in memory and the output tokens/s of greedy decoding at each batch
size (the prompts' prefill included), the sides alternated ``--rounds`` times. Usage:

    python benchmarks/awq_cpu.py [--batch-sizes 1 8] [--output-len 128] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
GROUP = 64
ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's nibble i holds column ORDER[i] of its eight


def pack(values):
    """4-bit values [rows, cols] -> AutoAWQ's int32 words [rows, cols / 8]."""
    import numpy as np
    import torch

    rows, cols = values.shape
    v = values.numpy().astype(np.uint32).reshape(rows, cols // 8, 8)[:, :, list(ORDER)]
    words = np.zeros((rows, cols // 8), dtype=np.uint32)
    for i in range(8):
        words |= v[:, :, i] << np.uint32(4 * i)
    return torch.from_numpy(words.view(np.int32).copy())


def make_awq(hf: Path, out: Path) -> None:
    """The HF copy's projections quantized per group of GROUP inputs (min/max, zero points)."""
    import torch
    from safetensors.torch import load_file, save_file

    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, w in load_file(hf / "model.safetensors").items():
        if not name.endswith("proj.weight"):
            tensors[name] = w
            continue
        wt = w.float().t()  # [in, out]
        g = wt.reshape(-1, GROUP, wt.shape[1])
        lo, hi = g.amin(1), g.amax(1)
        scales = ((hi - lo) / 15).clamp(min=1e-6).half()
        zeros = (-lo / scales.float()).round().clamp(0, 15)
        q = (g / scales.float()[:, None] + zeros[:, None]).round().clamp(0, 15)
        prefix = name[:-len(".weight")]
        tensors[f"{prefix}.qweight"] = pack(q.reshape(wt.shape).to(torch.int64))
        tensors[f"{prefix}.qzeros"] = pack(zeros.to(torch.int64))
        tensors[f"{prefix}.scales"] = scales
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    for f in hf.iterdir():
        if f.name != "model.safetensors":
            (out / f.name).write_bytes(f.read_bytes())
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": GROUP,
                                     "zero_point": True, "version": "gemm"}
    (out / "config.json").write_text(json.dumps(config))


def measure(path: str, quantization: str, batch: int, output_len: int) -> dict:
    """One side in this process: weights' bytes, and tokens/s of one batch."""
    from asyncengine import LLM, SamplingParams
    from asyncengine.executor.weights.quantization import weight_footprint

    llm = LLM(path, quantization=quantization, max_model_len=512)
    sizes = weight_footprint(llm.engine.runner.model)
    prompts = [[1, 9690, 198, 2683, 359, 253, 5356, 5646 + i, 28, 7018] for i in range(batch)]
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=8))  # warm-up
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"mb": sum(sizes.values()), "sizes": sizes, "tok_s": tokens / seconds}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--one", nargs=3, metavar=("PATH", "QUANTIZATION", "BATCH"),
                        help=argparse.SUPPRESS)  # a side, in its own process
    args = parser.parse_args()
    if args.one:
        path, quantization, batch = args.one
        print(json.dumps(measure(path, quantization, int(batch), args.output_len)))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        hf, awq = Path(tmp) / "hf", Path(tmp) / "awq"
        subprocess.run([sys.executable, str(HERE / "hf_copy.py"), "--out", str(hf)], check=True,
                       stdout=subprocess.DEVNULL)
        make_awq(hf, awq)
        print(f"AWQ copy of the embedded SmolLM2-135M: 4 bits, groups of {GROUP}; "
              f"{args.output_len} greedy tokens a request")
        env = {**os.environ, "PYTHONWARNINGS": "ignore"}
        for batch in args.batch_sizes:
            for r in range(args.rounds):
                row = {}
                for quantization in ("none", "auto"):
                    done = subprocess.run(
                        [sys.executable, __file__, "--one", str(awq), quantization, str(batch),
                         "--output-len", str(args.output_len)],
                        check=True, capture_output=True, text=True, env=env)
                    row[quantization] = json.loads(done.stdout.strip().splitlines()[-1])
                none, auto = row["none"], row["auto"]
                print(f"batch {batch}, round {r + 1}: dequantized {none['tok_s']:.1f} tok/s "
                      f"({none['mb']:.1f} MB of weights), int4 on its grid "
                      f"{auto['tok_s']:.1f} tok/s ({auto['mb']:.1f} MB): "
                      f"{auto['tok_s'] / none['tok_s']:.2f}x the speed, "
                      f"{auto['mb'] / none['mb']:.2f}x the memory", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
