"""A Q4_K_M file as people download them, served by asyncengine next to llama.cpp's
llama-server on the same file, in one run (``asyncengine bench peers``'s load: 100-token
prompts, 128 tokens out, streamed, ignore_eos, concurrency 1 and 32).

The model (``--shape``): Qwen2.5-0.5B's shape (``qwen2.5-0.5b``, the default: 24 layers,
hidden 896, MLP 4864, 14 heads / 2 KV heads, a 151936 vocabulary, tied embeddings) or Gemma 3
270M's (``gemma-3-270m``: 18 layers, hidden 640, MLP 2048, 4 heads / 1 KV head of 256, a
262144 vocabulary, tied embeddings, sliding window 512 on five layers of six), with random
weights made by transformers (std 0.02, seed 0), the SmolLM2 tokenizer (padded to the
vocabulary by the converter), converted by llama.cpp's own ``convert_hf_to_gguf.py`` to F16
and quantized to Q4_K_M by ``llama-quantize``: the file mixes Q4_K, Q6_K, Q5_0/Q8_0 and F32
as a downloaded one does.

    python benchmarks/kquants.py --llama-cpp DIR --llama-bin DIR [--work DIR] \\
        [--shape qwen2.5-0.5b|gemma-3-270m] [--concurrency 1 32] [--prompts-per-stream 4] \\
        [--skip-serve | --matrices] [--convert-path DIR] [--vllm-python PY [--vllm-args ARGS]]

``--llama-cpp``: llama.cpp's sources (``convert_hf_to_gguf.py`` and its ``gguf-py``), e.g.
the ``vendor/llama.cpp`` of the llama-cpp-python sdist; ``--llama-bin``: where
``llama-quantize`` and ``llama-server`` were built (cmake). Prints the file's types, then the
peers table with the ratios. Figures: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

QWEN25_05B = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864,
                  num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                  max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1000000.0,
                  tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
GEMMA3_270M = dict(vocab_size=262144, hidden_size=640, intermediate_size=2048,
                   num_hidden_layers=18, num_attention_heads=4, num_key_value_heads=1,
                   head_dim=256, sliding_window=512, query_pre_attn_scalar=256,
                   max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=True,
                   layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                                for i in range(18)],
                   rope_parameters={"full_attention": {"rope_type": "default",
                                                       "rope_theta": 1000000.0},
                                    "sliding_attention": {"rope_type": "default",
                                                          "rope_theta": 10000.0}},
                   bos_token_id=1, eos_token_id=2, pad_token_id=0)
# --shape: (transformers config class, architecture, its keyword arguments)
SHAPES = {"qwen2.5-0.5b": ("Qwen2Config", "Qwen2ForCausalLM", QWEN25_05B),
          "gemma-3-270m": ("Gemma3TextConfig", "Gemma3ForCausalLM", GEMMA3_270M)}


# llama.cpp's converter, run as it is except for two things: the SmolLM2 tokenizer re-saved by
# transformers hashes differently from the file the converter knows, so its pre-tokenizer
# is named here ("smollm", what the converter picks for SmolLM2's own tokenizer.json); and
# Gemma 3's converter cuts the embedding down to the tokenizer's own tokens (49152 here), so
# the embedding goes through the base class whole, as the padded vocabulary has it.
_CONVERT = """
import runpy, sys
from pathlib import Path
script = sys.argv[1]
sys.argv = sys.argv[1:]
sys.path.insert(0, str(Path(script).parent))
import conversion.base as base
import conversion.gemma as gemma
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "smollm"
_modify = gemma.Gemma3Model.modify_tensors
def modify_tensors(self, data, name, bid):
    if "embed_tokens.weight" in name:
        return base.TextModel.modify_tensors(self, data, name, bid)
    return _modify(self, data, name, bid)
gemma.Gemma3Model.modify_tensors = modify_tensors
runpy.run_path(script, run_name="__main__")
"""


def make_hf_model(directory: Path, tokenizer_dir: Path, shape: str = "qwen2.5-0.5b") -> None:
    import torch
    import transformers

    config_class, architecture, kwargs = SHAPES[shape]
    config = getattr(transformers, config_class)(**kwargs)
    config.architectures = [architecture]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(str(directory))
    for f in tokenizer_dir.iterdir():
        shutil.copy(f, directory / f.name)


def smollm2_tokenizer(work: Path) -> Path:
    """The embedded SmolLM2's tokenizer as an HF directory."""
    import transformers

    from asyncengine.executor.weights.loader import embedded_model_path

    target = work / "tokenizer"
    if not (target / "tokenizer_config.json").is_file():
        gguf = embedded_model_path()
        tok = transformers.AutoTokenizer.from_pretrained(os.path.dirname(gguf),
                                                         gguf_file=os.path.basename(gguf))
        tok.save_pretrained(str(target))
    return target


def make_q4_k_m(work: Path, llama_cpp: Path, llama_bin: Path, convert_path: str = "",
                shape: str = "qwen2.5-0.5b") -> Path:
    """The Q4_K_M file (made once; reused when present)."""
    out = work / f"{shape}-shape-Q4_K_M.gguf"
    if out.is_file():
        return out
    hf = hf_dir(work, shape)
    if not (hf / "config.json").is_file():
        make_hf_model(hf, smollm2_tokenizer(work), shape)
    f16 = work / f"{shape}-shape-F16.gguf"
    if not f16.is_file():
        # the converter imports sentencepiece even for a BPE tokenizer: ``--convert-path``
        # adds a folder holding it (``pip install --target DIR sentencepiece``)
        env = dict(os.environ)
        if convert_path:
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [convert_path,
                                                              env.get("PYTHONPATH")]))
        subprocess.run([sys.executable, "-c", _CONVERT, str(llama_cpp / "convert_hf_to_gguf.py"),
                        str(hf), "--outtype", "f16", "--outfile", str(f16)], check=True, env=env)
    subprocess.run([str(llama_bin / "llama-quantize"), str(f16), str(out), "Q4_K_M"],
                   check=True)
    return out


def hf_dir(work: Path, shape: str) -> Path:
    """The safetensors directory the file is converted from (``hf`` for the default shape, as
    before the shapes)."""
    return work / ("hf" if shape == "qwen2.5-0.5b" else f"hf-{shape}")


def file_types(path: Path) -> str:
    from asyncengine.executor.weights.gguf_header import read_header
    from asyncengine.executor.weights.kquants import type_name

    counts = Counter(type_name(t.ggml_type) for t in read_header(str(path)).tensors)
    return ", ".join(f"{k} x{v}" for k, v in counts.most_common())


def matrix_timing(path: Path) -> None:
    """Layer 0's gate (Q5_0) and down (Q6_K) projections, one thread, best of 20 calls (5 at
    2048 rows): the packed kernel against float32 and bfloat16 tiles (``kquants.TILE_ROWS``'
    measurement), and the bfloat16 model's own call (``GGUFLinear`` on bfloat16 rows: from 16
    rows the kernel's int8 tiles where the CPU has them, at 128 and 2048 rows a prefill chunk,
    against the bfloat16 tiles through oneDNN)."""
    import torch
    from kquant_mm import best  # benchmarks/kquant_mm.py: best of n calls after one warm-up

    from asyncengine.executor.kernels import packed as packed_kernels
    from asyncengine.executor.weights import kquants
    from asyncengine.executor.weights.gguf import read_packed
    from asyncengine.executor.weights.loader import resolve_model

    torch.set_num_threads(1)
    source = resolve_model(str(path))
    packed = read_packed(source.gguf_path, source.hf_config)

    print("rows  matrix           type   kernel ms  f32 tiles ms  bf16 tiles ms  bf16 model ms")
    for m in (1, 4, 8, 16, 32, 128, 2048):
        reps = 20 if m <= 128 else 5
        for name in ("model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.down_proj.weight"):
            t = packed[name]
            lin = kquants.GGUFLinear(t.k, [kquants.Part(t.raw, t.qtype)])
            x = torch.randn(m, t.k)
            out = torch.empty(m, t.raw.shape[0])
            xb = x.bfloat16()
            kernel = best(functools.partial(packed_kernels.kquant_mm, x, t.raw, t.qtype, out),
                          reps)
            f32 = best(functools.partial(lin._tiled, x), reps)
            bf16 = best(functools.partial(lin._tiled, xb), reps)
            model = best(functools.partial(lin, xb), reps)
            print(f"{m:4d}  {name.split('.')[3]:15s}  {kquants.type_name(t.qtype):5s} "
                  f"{kernel:10.3f} {f32:13.3f} {bf16:14.3f} {model:14.3f}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--llama-cpp", type=Path, required=True)
    parser.add_argument("--llama-bin", type=Path, required=True)
    parser.add_argument("--convert-path", default="",
                        help="a folder added to PYTHONPATH for convert_hf_to_gguf.py")
    parser.add_argument("--work", type=Path, default=Path("/tmp/asyncengine-kquants-bench"))
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-0.5b",
                        help="the model's shape (random weights)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--prompts-per-stream", type=int, default=4,
                        help="requests per run: this times the concurrency, at least 8")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                        help="CPU threads of each server")
    parser.add_argument("--matrices", action="store_true",
                        help="time layer 0's matrices (kernel vs tiles) instead of serving")
    parser.add_argument("--skip-serve", action="store_true",
                        help="make the file and stop")
    parser.add_argument("--asyncengine-args", default="")
    parser.add_argument("--vllm-python", default=None,
                        help="a Python that imports vLLM's CPU build (docs/benchmarks.md): vLLM "
                             "serves the same random weights from the safetensors directory the "
                             "GGUF was converted from")
    parser.add_argument("--vllm-args", default="--dtype bfloat16 --gpu-memory-utilization 0.3",
                        help="vLLM's flags (default: bfloat16, its better dtype on CPUs with "
                             "AVX-512 BF16, and 30%% of the memory for its KV cache: on the CPU "
                             "--gpu-memory-utilization is the share of the machine's memory)")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    path = make_q4_k_m(args.work, args.llama_cpp, args.llama_bin, args.convert_path, args.shape)
    print(f"{path} ({path.stat().st_size / 2**20:.0f} MB): {file_types(path)}", flush=True)
    if args.matrices:
        matrix_timing(path)
        return 0
    if args.skip_serve:
        return 0
    from asyncengine.entrypoints.bench import peers

    bench = argparse.ArgumentParser()
    peers.add_arguments(bench)
    argv = ["--model", str(path), "--gguf", str(path),
            "--llama-server", str(args.llama_bin / "llama-server"),
            "--peers", "asyncengine", "llama-server", *(["vllm"] if args.vllm_python else []),
            "--concurrency", *map(str, args.concurrency),
            "--prompts-per-stream", str(args.prompts_per_stream), "--threads", str(args.threads),
            "--asyncengine-args", f"--tokenizer {args.work / 'tokenizer'} "
                                  + args.asyncengine_args]
    if args.vllm_python:
        argv += ["--vllm-python", args.vllm_python, "--hf-model", str(hf_dir(args.work,
                                                                            args.shape)),
                 "--vllm-args", args.vllm_args]
    return peers.main(bench.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
