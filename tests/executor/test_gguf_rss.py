"""A GGUF file's weights in memory stay within its size.

Loading one kept packed makes no float copy of its weights, not even transiently: the peak RSS
of a process loading it grows by at most 1.2x the file's size (the test builds the model's
skeleton first: its RoPE tables and imports are the baseline). And an engine serving a file
whose vocabulary is tied to the head, packed (``gguf``) or as int4 / int8 layers (``auto``
for Q4_0 / Q4_1 / Q8_0 files), holds the vocabulary once: its resident set after generating a
few tokens is within 1.15x the file (the KV cache and the tokenizer aside; measured once
engines on a narrower file of the same shape have loaded the imports and kernels).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from tests.executor.test_kquants import quantized_matrix, write_mixed_gguf

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
from asyncengine.executor.weights import gguf as gguf_mod, quantization
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


def _run(child: str, *args: str) -> dict:
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": root}
    out = subprocess.run([sys.executable, "-c", child, *args], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def peak_growth(path: str) -> dict[str, int]:
    """Bytes the peak RSS of a fresh process grows by while loading ``path`` packed
    (``--quantization auto``), then again dequantized (``none``)."""
    return _run(_CHILD, path)


def test_loading_packed_peaks_under_1_2x_the_file(tmp_path):
    path = write_mixed_gguf(str(tmp_path / "tiny-Q4_K_M.gguf"))
    size = os.path.getsize(path)
    growth = peak_growth(path)
    assert growth["packed"] <= 1.2 * size, (
        f"peak RSS grew {growth['packed'] / 2**20:.1f} MB, file {size / 2**20:.1f} MB")
    # and the measure sees a float copy: dequantized, the same file costs ~4x its size
    assert growth["none"] > 2 * size, growth


def write_tied_gguf(path: str, hidden: int = 256, layers: str = "Q4_0",
                    embedding: str = "Q8_0", seed: int = 0) -> str:
    """A tiny Gemma 3 in the shape of gemma-3-270m's file (a vocabulary much larger than the
    layers, tied to the head; one KV head wider than ``hidden / heads``; a sliding layer and a
    global one, sandwich norms, q/k norms) with its matrices in ``layers`` and its embedding in
    ``embedding`` (Q8_0 beside Q4_0 layers: what ``--quantization auto`` takes as int4, as the
    embedded SmolLM2's Q4_1 / Q8_0 file)."""
    import gguf
    from gguf import GGMLQuantizationType as T

    rng = np.random.default_rng(seed)
    heads, head_dim, ffn, vocab = 2, hidden // 2, 2 * hidden, 49152
    w = gguf.GGUFWriter(path, "gemma3")
    w.add_block_count(2)
    w.add_context_length(512)  # small RoPE tables: RSS measures the weights
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(1)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(1000000.0)
    w.add_sliding_window(8)
    w.add_uint32("gemma3.attention.sliding_window_pattern", 2)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(vocab)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)

    def matrix(name: str, qtype: str, rows: int, k: int) -> None:
        w.add_tensor(name, quantized_matrix(T[qtype], rows, k, rng), raw_dtype=T[qtype])

    def norm(name: str, n: int) -> None:  # stored as 1 + w, as llama.cpp's converter does
        w.add_tensor(name, (1.0 + rng.standard_normal(n) * 0.1).astype(np.float32))

    matrix("token_embd.weight", embedding, vocab, hidden)
    norm("output_norm.weight", hidden)
    shapes = {"attn_q": (heads * head_dim, hidden), "attn_k": (head_dim, hidden),
              "attn_v": (head_dim, hidden), "attn_output": (hidden, heads * head_dim),
              "ffn_gate": (ffn, hidden), "ffn_up": (ffn, hidden), "ffn_down": (hidden, ffn)}
    for i in range(2):
        for part, shape in shapes.items():
            matrix(f"blk.{i}.{part}.weight", layers, *shape)
        for part in ("attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm"):
            norm(f"blk.{i}.{part}.weight", hidden)
        for part in ("attn_q_norm", "attn_k_norm"):
            norm(f"blk.{i}.{part}.weight", head_dim)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# Engines one after another in one process: a first on a file of the same shape 4x narrower
# (per quantization) brings in the imports, compiled kernels and thread pools; then each
# measured engine's growth from where the one before it was freed, its KV cache aside, is what
# serving the file costs. Its few steps' buffers and tables are part of it; the tokenizer
# (~46 MB for SmolLM2's, loaded by each engine) is not: all share one.
_ENGINE_CHILD = r"""
import ctypes, gc, json, sys
def rss():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) * 1024
from asyncengine import LLM, SamplingParams
from asyncengine.executor import build
from asyncengine.executor.weights.quantization import weight_footprint
path, warm, tokenizer, *quantizations = sys.argv[1:]
tokenizers = {}
def load_tokenizer(name, _load=build.load_tokenizer, **kw):
    if name not in tokenizers:
        tokenizers[name] = _load(name, **kw)
    return tokenizers[name]
build.load_tokenizer = load_tokenizer
def engine(path, quantization):
    return LLM(path, tokenizer=tokenizer, quantization=quantization, max_model_len=64,
               block_size=8, num_gpu_blocks_override=8, max_num_seqs=2,
               max_num_batched_tokens=32)
params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
prompt = [[1, 510, 2801, 4431, 17, 99, 2000, 7, 8, 9]]
for quantization in quantizations:
    engine(warm, quantization).generate(prompt, params)
got = {}
for quantization in quantizations:
    gc.collect()
    ctypes.CDLL(None).malloc_trim(0)  # the engine before's freed pages back to the system
    before = rss()
    llm = engine(path, quantization)
    out = llm.generate(prompt, params)
    after = rss()
    runner = llm.engine.runner
    kv = sum(t.untyped_storage().nbytes() for t in runner.kv_caches)
    got[quantization] = {
        "resident": after - before - kv,
        "footprint": sum(weight_footprint(runner.model).values()) * 2**20,
        "layers": [type(runner.model.model.embed_tokens).__name__,
                   type(runner.model.lm_head).__name__],
        "tokens": out[0].outputs[0].token_ids}
    del llm, runner
print(json.dumps(got))
"""

# Above 1.15x the file: what an engine's few steps hold beyond the weights, 0 to 3.2 MB over
# 10 runs on this file (the logits of a step's rows, 49152 floats each; its activations; two
# RoPE tables of 1024 positions; allocator slack), twice that for a busier machine's heap.
_ALLOWANCE = 6 << 20


def test_serving_a_tied_vocabulary_holds_it_once(tmp_path):
    from tests.utils import embedded_tokenizer_dir

    path = write_tied_gguf(str(tmp_path / "tied.gguf"))
    warm = write_tied_gguf(str(tmp_path / "warm.gguf"), hidden=64)
    size = os.path.getsize(path)
    got = _run(_ENGINE_CHILD, path, warm, str(embedded_tokenizer_dir()), "auto", "gguf")
    # auto: int4 layers and the head on the embedding's Q8_0 grid, which the lookups read;
    # gguf: kept packed, the head reading the embedding's bytes
    assert got["auto"]["layers"] == ["Int8Embedding", "Int8Linear"]
    assert got["gguf"]["layers"] == ["GGUFEmbedding", "GGUFLinear"]
    for quantization, g in got.items():
        assert len(g["tokens"]) == 8
        assert g["footprint"] <= 1.15 * size, (quantization, g)  # the tied bytes counted once
        assert g["resident"] <= 1.15 * size + _ALLOWANCE, (
            f"{quantization}: the resident set grew {g['resident'] / 2**20:.1f} MB beyond the "
            f"KV cache, file {size / 2**20:.1f} MB")
