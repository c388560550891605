"""GGUF types kept packed (``executor/weights/kquants.py``, ``kernels/kquant*.cpp``): every type
dequantizes bit-exactly as the ``gguf`` package's reference does, and the packed matmul equals
a float matmul by those weights."""

from __future__ import annotations

import os
import re

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncengine.executor.weights import kquants

# Where each type's float16 scales sit in its block (byte offsets), to make them finite.
_F16_FIELDS = {T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q5_1: (0, 2), T.Q8_0: (0,),
               T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,), T.IQ4_XS: (0,)}
TYPES = [T(t) for t in kquants.TYPES]


def random_rows(qtype: T, rows: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """uint8 [rows, row bytes] of random blocks of ``qtype`` with finite float scales."""
    _, block, size = kquants.TYPES[qtype]
    if qtype in (T.F32, T.F16, T.BF16):
        w = (rng.standard_normal((rows, k)) * 10.0 ** rng.integers(-6, 4)).astype(np.float32)
        if qtype == T.F16:
            return w.astype(np.float16).view(np.uint8)
        if qtype == T.BF16:
            return (w.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
        return w.view(np.uint8)
    blocks = rng.integers(0, 256, (rows * k // block, size), dtype=np.uint8)
    for off in _F16_FIELDS[qtype]:
        # scales over float16's range, subnormals included
        scale = rng.standard_normal(len(blocks)) * 10.0 ** rng.integers(-7, 3, len(blocks))
        blocks[:, off:off + 2] = scale.astype(np.float16).reshape(-1, 1).view(np.uint8)
    return blocks.reshape(rows, -1)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), rows=st.integers(1, 5), blocks=st.integers(1, 3))
def test_dequantize_is_bit_exact(qtype: T, seed: int, rows: int, blocks: int) -> None:
    block = kquants.TYPES[qtype][1]
    k = max(block, 32) * blocks
    raw = random_rows(qtype, rows, k, np.random.default_rng(seed))
    want = dequantize(raw, qtype).reshape(rows, k).astype(np.float32)
    got = kquants.dequantize_rows(torch.from_numpy(raw.copy()), int(qtype), k).numpy()
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    # a few rows picked by id (the embedding lookup), repeated and out of order
    ids = torch.tensor([rows - 1, 0, rows - 1])
    picked = kquants.dequantize_rows(torch.from_numpy(raw.copy()), int(qtype), k, ids).numpy()
    assert np.array_equal(picked.view(np.uint32), want[ids.numpy()].view(np.uint32))
    # straight to bfloat16 (the bfloat16 tiles): the float32 weights rounded once, as torch does
    half = kquants.dequantize_rows(torch.from_numpy(raw.copy()), int(qtype), k, None,
                                   torch.bfloat16)
    assert torch.equal(half.view(torch.int16),
                       torch.from_numpy(want).to(torch.bfloat16).view(torch.int16))


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q5_K, T.Q6_K, T.Q5_0, T.Q5_1, T.Q4_0, T.Q8_0,
                                   T.IQ4_XS, T.F16],
                         ids=lambda t: t.name)
@pytest.mark.parametrize("m", [1, 3, 7, 12, 70])
def test_packed_matmul_equals_float_matmul(qtype: T, m: int) -> None:
    rng = np.random.default_rng(int(qtype) * 10 + m)
    # blocks of 32: 29 of them, the kernel's groups of 8, 4 and 1 (kquant.cpp)
    k, n = (512 if kquants.TYPES[qtype][1] == 256 else 928), 37
    raw = torch.from_numpy(random_rows(qtype, n, k, rng).copy())
    if qtype not in (T.F16,):  # tame the random scales: unit-ish weights
        w0 = kquants.dequantize_rows(raw, int(qtype), k)
        assert torch.isfinite(w0).all()
    lin = kquants.GGUFLinear(k, [kquants.Part(raw, int(qtype))])
    x = torch.randn(m, k)
    w = kquants.dequantize_rows(raw, int(qtype), k).double()
    want = x.double() @ w.T
    got = lin(x).double()
    scale = (x.double().abs() @ w.abs().T).clamp_min(1e-30)
    # Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / Q4_K / Q5_K / Q6_K / IQ4_XS below TILE_ROWS rows: byte
    # dot products over activations rounded to int8 twice per block (exact to ~1.5e-5 of the
    # block maximum, kquant.cpp)
    rounded = qtype in (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K,
                        T.IQ4_XS) and m < kquants.TILE_ROWS
    assert ((got - want).abs() / scale).max() < (5e-5 if rounded else 1e-5)



@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K, T.Q5_0, T.Q4_0, T.Q8_0], ids=lambda t: t.name)
def test_packed_rows_do_not_depend_on_the_batch(qtype: T) -> None:
    """Below TILE_ROWS rows each input row's result is the same to the bit whether it is
    multiplied alone or with others (a one-token step and a speculative verification of the
    same request must agree for greedy output to stay identical)."""
    rng = np.random.default_rng(int(qtype))
    k = 512 if kquants.TYPES[qtype][1] == 256 else 928
    raw = torch.from_numpy(random_rows(qtype, 37, k, rng).copy())
    lin = kquants.GGUFLinear(k, [kquants.Part(raw, int(qtype))])
    x = torch.randn(kquants.TILE_ROWS - 1, k)
    together = lin(x)
    for i in range(x.shape[0]):
        assert torch.equal(lin(x[i:i + 1])[0], together[i])

# ---- a tiny model in Q4_K_M's mix of types, against transformers loading the same file ----

# Layer 0 as llama-quantize's Q4_K_M lays a layer out (Q4_K, Q6_K for attn_v and ffn_down),
# layer 1 every other type; the tied embedding (and so the head) Q6_K; norms, biases F32.
MIX = {
    0: {"attn_q": T.Q4_K, "attn_k": T.Q4_K, "attn_v": T.Q6_K, "attn_output": T.Q4_K,
        "ffn_gate": T.Q4_K, "ffn_up": T.Q4_K, "ffn_down": T.Q6_K},
    1: {"attn_q": T.Q5_K, "attn_k": T.Q8_0, "attn_v": T.Q5_0, "attn_output": T.IQ4_XS,
        "ffn_gate": T.Q4_0, "ffn_up": T.Q5_1, "ffn_down": T.Q4_1},
}
HIDDEN, FFN, HEADS, KV_HEADS, VOCAB = 256, 512, 4, 2, 49152


def quantized_matrix(qtype: T, rows: int, k: int, rng: np.random.Generator,
                     std: float = 0.05) -> np.ndarray:
    """A [rows, k] matrix of ``qtype`` as file bytes: ``gguf.quants.quantize`` of normal
    weights where gguf can quantize the type, else random valid blocks with their float16
    scales set to give weights of about ``std``."""
    from gguf.quants import quantize

    try:
        return quantize((rng.standard_normal((rows, k)) * std).astype(np.float32), qtype)
    except NotImplementedError:
        pass
    raw = random_rows(qtype, rows, k, rng)
    _, block, size = kquants.TYPES[qtype]
    blocks = raw.reshape(-1, size)
    for off in _F16_FIELDS[qtype]:  # unit scales, then one factor for the whole matrix
        blocks[:, off:off + 2] = np.float16(1.0).reshape(1, 1).view(np.uint8)
    unit = dequantize(raw, qtype).std()
    for off in _F16_FIELDS[qtype]:
        vary = rng.uniform(0.5, 1.5, len(blocks)) * std / unit
        blocks[:, off:off + 2] = vary.astype(np.float16).reshape(-1, 1).view(np.uint8)
    return raw


def write_mixed_gguf(path: str, seed: int = 0) -> str:
    """A tiny Qwen2 (tied embeddings, q/k/v biases) whose matrices are ``MIX``'s types."""
    import gguf

    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(path, "qwen2")
    w.add_block_count(len(MIX))
    w.add_context_length(512)  # small RoPE tables: RSS measures the weights
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(1000000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(VOCAB)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    head_dim = HIDDEN // HEADS

    def matrix(name: str, qtype: T, rows: int, k: int) -> None:
        w.add_tensor(name, quantized_matrix(qtype, rows, k, rng), raw_dtype=qtype)

    def vector(name: str, n: int, mean: float, std: float) -> None:
        w.add_tensor(name, (mean + rng.standard_normal(n) * std).astype(np.float32))

    matrix("token_embd.weight", T.Q6_K, VOCAB, HIDDEN)
    vector("output_norm.weight", HIDDEN, 1.0, 0.1)
    shapes = {"attn_q": (HIDDEN, HIDDEN), "attn_k": (KV_HEADS * head_dim, HIDDEN),
              "attn_v": (KV_HEADS * head_dim, HIDDEN), "attn_output": (HIDDEN, HIDDEN),
              "ffn_gate": (FFN, HIDDEN), "ffn_up": (FFN, HIDDEN), "ffn_down": (HIDDEN, FFN)}
    for i, types in MIX.items():
        vector(f"blk.{i}.attn_norm.weight", HIDDEN, 1.0, 0.1)
        vector(f"blk.{i}.ffn_norm.weight", HIDDEN, 1.0, 0.1)
        for part, qtype in types.items():
            matrix(f"blk.{i}.{part}.weight", qtype, *shapes[part])
        for part in ("attn_q", "attn_k", "attn_v"):
            vector(f"blk.{i}.{part}.bias", shapes[part][0], 0.0, 0.1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def mixed_gguf(tmp_path_factory) -> str:
    return write_mixed_gguf(str(tmp_path_factory.mktemp("kq") / "tiny-Q4_K_M.gguf"))


def test_mixed_types_load_packed(mixed_gguf):
    from asyncengine.executor.weights.loader import load_model, resolve_model

    model = load_model(resolve_model(mixed_gguf), "auto", torch.float32, "cpu",
                       quantization="auto")
    linears = {n: m for n, m in model.named_modules() if isinstance(m, kquants.GGUFLinear)}
    qkv0 = linears["model.layers.0.self_attn.qkv_proj"]
    assert [T(t) for t in qkv0.qtypes] == [T.Q4_K, T.Q4_K, T.Q6_K]
    assert [T(t) for t in linears["model.layers.1.self_attn.qkv_proj"].qtypes] == [
        T.Q5_K, T.Q8_0, T.Q5_0]
    assert isinstance(model.model.embed_tokens, kquants.GGUFEmbedding)
    assert model.lm_head.raw0.data_ptr() == model.model.embed_tokens.raw.data_ptr()  # tied
    # nothing float but the norms and biases
    floats = sum(t.numel() for t in model.parameters() if t.dtype.is_floating_point)
    assert floats < 10 * HIDDEN * len(MIX) + HIDDEN


def test_mixed_types_give_transformers_greedy_tokens(mixed_gguf):
    from asyncengine import LLM, SamplingParams
    from tests.engine.test_engine import hf_greedy
    from tests.utils import embedded_tokenizer_dir, hf_reference_model

    hf = hf_reference_model(mixed_gguf)
    llm = LLM(mixed_gguf, tokenizer=str(embedded_tokenizer_dir()), dtype="float32",
              max_num_batched_tokens=32, max_num_seqs=4, num_gpu_blocks_override=16,
              block_size=8, max_model_len=64)
    prompts = [[1, 510, 2801, 4431, 17, 99, 2000], [7, 8, 9, 10, 11, 12, 13, 14, 15, 16],
               list(range(100, 140))]  # the last: two prefill chunks, the tiled path
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    for p, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(hf, p, 8)[0]
    assert llm.engine.num_free_blocks == llm.engine.num_total_blocks


def test_int8_tiles_from_few_rows_only_without_speculation(mixed_gguf):
    """A bfloat16 GGUF model takes the int8 tiles from 3 rows where no drafts are verified;
    with speculation its rows below ``TILE_ROWS`` keep the byte dot products, whose result for
    a row is the same in a 1-row step and a 1 + k row verification."""
    from asyncengine import LLM
    from asyncengine.executor.kernels import packed as packed_kernels
    from tests.utils import embedded_tokenizer_dir

    if not (kquants.kernels_available() and packed_kernels.kquant_int8_tile()):
        pytest.skip("no AVX-512 BF16 + VNNI + BITALG here")
    few = {}
    for spec in (None, '{"method": "ngram", "num_speculative_tokens": 4}'):
        llm = LLM(mixed_gguf, tokenizer=str(embedded_tokenizer_dir()), dtype="bfloat16",
                  max_num_seqs=4, num_gpu_blocks_override=16, block_size=8, max_model_len=64,
                  speculative_config=spec)
        lins = [m for m in llm.engine.runner.model.modules()
                if isinstance(m, kquants.GGUFLinear) and m.int8_tiles]
        assert lins
        few[spec is None] = {m.few_row_tiles for m in lins}
        flags = {m.flag(torch.bfloat16) for m in lins} | {m.flag(torch.float32) for m in lins}
        assert flags == ({packed_kernels.KQ_TILE8_FEW, 0} if spec is None else {0})
        del llm
    assert few == {True: {True}, False: {False}}


# ---- bad input: one line naming the tensor and its type (or the offset), and the types ----


def _with_tensor_type(src: str, dst: str, tensor: str, qtype: int) -> str:
    """A copy of the GGUF ``src`` whose ``tensor`` claims GGML type ``qtype``."""
    from asyncengine.executor.weights.gguf_header import read_header

    data = bytearray(open(src, "rb").read())
    name = tensor.encode()
    at = data.index(len(name).to_bytes(8, "little") + name) + 8 + len(name)
    n_dims = int.from_bytes(data[at:at + 4], "little")
    at += 4 + 8 * n_dims  # the type follows the dims
    data[at:at + 4] = qtype.to_bytes(4, "little")
    open(dst, "wb").write(bytes(data))
    read_header(dst)  # still a readable header
    return dst


@pytest.fixture(scope="module")
def bad_files(mixed_gguf, tmp_path_factory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("bad")
    size = os.path.getsize(mixed_gguf)
    truncated = str(d / "truncated.gguf")
    with open(mixed_gguf, "rb") as f:
        open(truncated, "wb").write(f.read(size * 2 // 3))
    return {
        "unsupported": _with_tensor_type(mixed_gguf, str(d / "q2k.gguf"),
                                         "blk.1.ffn_up.weight", int(T.Q2_K)),
        "unknown": _with_tensor_type(mixed_gguf, str(d / "t99.gguf"),
                                     "blk.0.attn_q.weight", 99),
        "truncated": truncated,
    }


BAD = {"unsupported": r"tensor blk\.1\.ffn_up\.weight has GGML type Q2_K.*supported: .*Q4_K",
       "unknown": r"tensor blk\.0\.attn_q\.weight has GGML type type 99.*supported: .*Q6_K",
       "truncated": r"truncated or corrupt GGUF file: tensor \S+ \(\w+\) at offset \d+"}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_gguf_raises_one_line_value_error(bad_files, case):
    from asyncengine import LLM

    with pytest.raises(ValueError, match=BAD[case]) as info:
        LLM(bad_files[case], tokenizer=str(_tokenizer()), dtype="float32", max_model_len=64)
    assert "\n" not in str(info.value)


def _tokenizer() -> str:
    from tests.utils import embedded_tokenizer_dir

    return str(embedded_tokenizer_dir())


def test_bad_gguf_cli_exits_2_without_traceback(bad_files):
    from tests.cli.test_cli import run_cli

    r = run_cli("serve", bad_files["unsupported"], "--tokenizer", _tokenizer(),
                "--dtype", "float32", "--port", "0")
    assert r.returncode == 2, r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    assert re.search(BAD["unsupported"], r.stderr)


def test_bfloat16_batches_match_float32():
    """From ``TILE_ROWS`` rows, bfloat16 inputs take the tiled path (bfloat16 tiles where the
    CPU has bfloat16 dot products): close to the float32 result, returned in bfloat16."""
    rng = np.random.default_rng(5)
    k, n = 512, 300
    raw = torch.from_numpy(quantized_matrix(T.Q4_K, n, k, rng))
    lin = kquants.GGUFLinear(k, [kquants.Part(raw, int(T.Q4_K))])
    for m in (1, kquants.TILE_ROWS, 33):
        x = torch.randn(m, k)
        want = lin(x)
        got = lin(x.bfloat16())
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), want, atol=0.05 * want.abs().max().item(),
                                   rtol=0.02)


def test_kernels_build_where_the_compiler_works():
    # where the other packed kernels build, the GGUF ones must too: the tests above would pass
    # on the slow PyTorch fallback and hide a build failure
    from asyncengine.executor.kernels import packed as packed_kernels

    if not packed_kernels.available("int4"):
        pytest.skip("no C++ toolchain here")
    assert kquants.kernels_available()
    assert packed_kernels._load("kquant_dequant", 1) is not None  # the bfloat16 tiles'
    # and the int8 tiles where the CPU has what they need (their tests would skip otherwise)
    with open("/proc/cpuinfo") as f:
        flags = set(next((line for line in f if line.startswith("flags")), "").split())
    if {"avx512_bf16", "avx512_vnni", "avx512_bitalg", "avx512bw", "avx512vl"} <= flags:
        assert packed_kernels.kquant_int8_tile()


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_fused_bfloat16_tiles_match_the_tiled_path(qtype, monkeypatch):
    """From ``TILE_ROWS`` rows of a bfloat16 model, ``kquant_tile.h`` multiplies the
    dequantized bfloat16 tiles inside the kernel: the arithmetic of ``_tiled``'s bfloat16
    tiles (the same roundings of weights and inputs, float32 sums) up to summation order;
    row and column counts that leave short register tiles."""
    from asyncengine.executor.kernels import packed as packed_kernels
    from asyncengine.executor.runtime import cpu_flags

    if not (kquants.kernels_available() and packed_kernels.kquant_bf16_tile()):
        pytest.skip("no AVX-512 BF16 here")
    monkeypatch.setattr(cpu_flags, "cpu_has_bf16", lambda: True)  # the suite runs without
    rng = np.random.default_rng(11)
    k, n = 512, 301
    make = random_rows if qtype in (T.F32, T.F16, T.BF16) else quantized_matrix
    raw = torch.from_numpy(np.ascontiguousarray(make(qtype, n, k, rng)))
    lin = kquants.GGUFLinear(k, [kquants.Part(raw, int(qtype))])
    for m in (kquants.TILE_ROWS, 19, 33):
        x = torch.randn(m, k).bfloat16()
        got = lin(x)
        want = lin._tiled(x)
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), want.float(),
                                   atol=0.01 * want.abs().max().item(), rtol=0.01)


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q5_K, T.Q6_K, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1,
                                   T.Q8_0], ids=lambda t: t.name)
def test_fused_bfloat16_tiles_dequantize_bit_exactly(qtype, monkeypatch):
    """``kquant_tile.h`` unpacks each weight row straight to bfloat16 in registers: one-hot
    inputs read the weights back, which must be the ``gguf`` reference rounded to bfloat16
    once, to the bit."""
    from asyncengine.executor.kernels import packed as packed_kernels
    from asyncengine.executor.runtime import cpu_flags

    if not (kquants.kernels_available() and packed_kernels.kquant_bf16_tile()):
        pytest.skip("no AVX-512 BF16 here")
    monkeypatch.setattr(cpu_flags, "cpu_has_bf16", lambda: True)
    rng = np.random.default_rng(int(qtype))
    k, n = (512 if kquants.TYPES[qtype][1] == 256 else 544), 37  # 17 blocks of 32: a pair short
    raw = random_rows(qtype, n, k, rng)
    want = torch.from_numpy(dequantize(raw, qtype).reshape(n, k).astype(np.float32))
    w = torch.from_numpy(raw.copy())
    eye = torch.eye(k)
    out = torch.empty(32, n)
    for c0 in range(0, k, 32):  # 32 one-hot rows at a time: the fused tiles' regime
        # (the flag: the bfloat16 tiles also for the types kquant_tile8.h takes on this CPU)
        packed_kernels.kquant_mm(eye[c0:c0 + 32], w, int(qtype) | packed_kernels.KQ_BF16_TILES,
                                 out)
        assert torch.equal(out.T.bfloat16().float(), want[:, c0:c0 + 32].bfloat16().float())


def int8_rounded_matmul(x: torch.Tensor, raw: np.ndarray, qtype: T, k: int) -> torch.Tensor:
    """What ``kquant_tile8.h`` computes, in float64: the activations rounded to int8 per block
    of 32 as ``common.h`` rounds them (d = max|x| / 127 and x / d rounded to nearest even, in
    float32), the weights exact; Q4_1 / Q5_1's min term (with ``c d`` for the centred quants)
    times the float sum of the block's x."""
    m, n, blocks = x.shape[0], raw.shape[0], k // 32
    xb = x.numpy().astype(np.float32).reshape(m, blocks, 32)
    d = (np.abs(xb).max(-1) / np.float32(127)).astype(np.float32)
    inv = np.where(d > 0, np.float32(1) / np.where(d > 0, d, 1), 0).astype(np.float32)
    xq = np.rint((xb * inv[..., None]).astype(np.float32)).astype(np.float64)
    w = dequantize(raw, qtype).reshape(n, blocks, 32).astype(np.float64)
    c = np.zeros((n, blocks))  # the part of each block's weights taken by the float sum of x
    size = kquants.TYPES[qtype][2]
    if qtype in (T.Q4_1, T.Q5_1):  # d q + m = d (q - 8 or 16) + (m + 8 or 16 d)
        f16 = raw.reshape(n, blocks, size)[..., :4].copy().view(np.float16).astype(np.float32)
        c = f16[..., 1] + (16 if qtype == T.Q5_1 else 8) * f16[..., 0]
    elif qtype in (T.Q4_K, T.Q5_K):  # (d sc) q - dmin mn = (d sc) (q - 8 or 16) + ...
        sb = raw.reshape(n, k // 256, size)
        f16 = sb[..., :4].copy().view(np.float16).astype(np.float32)  # d, dmin
        s = sb[..., 4:16].astype(np.int32)
        sc = np.concatenate([s[..., :4] & 63, (s[..., 8:] & 15) | ((s[..., :4] >> 2) & 48)], -1)
        mn = np.concatenate([s[..., 4:8] & 63, (s[..., 8:] >> 4) | ((s[..., 4:8] >> 2) & 48)],
                            -1)
        dsc = f16[..., :1] * sc.astype(np.float32)
        c = ((16 if qtype == T.Q5_K else 8) * dsc - f16[..., 1:] * mn).reshape(n, blocks)
    ints = np.einsum("nbj,mbj->mnb", w - c[..., None], xq) * d[:, None, :]
    mins = np.einsum("nb,mb->mn", c, xb.astype(np.float64).sum(-1))
    return torch.from_numpy(ints.sum(-1) + mins)


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q5_K,
                                   T.Q6_K], ids=lambda t: t.name)
def test_int8_tiles_compute_their_rounding_exactly(qtype, monkeypatch):
    """From ``TILE_ROWS`` rows of a bfloat16 model, ``kquant_tile8.h`` multiplies the blocks of
    32 and the k-quants by byte dot products across 16 weight rows: the activations' int8
    rounding (per block of 32) is the only approximation (every block's sum is exact in
    int32), the result is within the float32 roundings of that rounded product, close to the
    float product, and each row's result does not depend on the batch (16 to 64 rows; short
    strips and row groups included)."""
    from asyncengine.executor.kernels import packed as packed_kernels
    from asyncengine.executor.runtime import cpu_flags

    if not (kquants.kernels_available() and packed_kernels.kquant_int8_tile()):
        pytest.skip("no AVX-512 BF16 + VNNI + BITALG here")
    monkeypatch.setattr(cpu_flags, "cpu_has_bf16", lambda: True)
    rng = np.random.default_rng(int(qtype) + 40)
    # 29 blocks of 32 / 3 super-blocks; 2 strips of 16 rows and a short one
    k, n = (768 if kquants.TYPES[qtype][1] == 256 else 928), 37
    raw = quantized_matrix(qtype, n, k, rng)
    w = torch.from_numpy(raw.copy())
    wf = torch.from_numpy(dequantize(raw, qtype).reshape(n, k)).double()
    x = torch.randn(150, k)  # a prefill chunk's two row panels (kquant_tile8.h: 128 rows)
    x[3, :64] = 0.0  # all-zero blocks
    together = torch.empty(150, n)
    packed_kernels.kquant_mm(x, w, int(qtype), together)
    scale = (x.double().abs() @ wf.abs().T).clamp_min(1e-30)
    want = int8_rounded_matmul(x, raw, qtype, k)
    assert ((together.double() - want).abs() / scale).max() < 1e-5
    assert ((together.double() - x.double() @ wf.T).abs() / scale).max() < 1e-2
    for m in (16, 19, 33, 64):
        out = torch.empty(m, n)
        packed_kernels.kquant_mm(x[:m].contiguous(), w, int(qtype), out)
        assert torch.equal(out, together[:m])
    # and through the model's linear, bfloat16 in and out (read and written by the kernel as
    # they are): the float32 call's sums rounded once
    lin = kquants.GGUFLinear(k, [kquants.Part(w, int(qtype))])
    for m in (19, 150):
        xb = x[:m].bfloat16()
        out = torch.empty(m, n)
        packed_kernels.kquant_mm(xb.float(), w, int(qtype), out)
        assert torch.equal(lin(xb), out.bfloat16())
    # with the few-row flag (no speculation) the int8 tiles from 3 rows: the same rows
    for m in (3, 4, 8, 15):
        out = torch.empty(m, n)
        packed_kernels.kquant_mm(x[:m].contiguous(), w, int(qtype) | packed_kernels.KQ_TILE8_FEW,
                                 out)
        assert torch.equal(out, together[:m])
    # bfloat16 in or out where another path takes the call (3 rows): widened, then rounded
    xb = x[:3].bfloat16()
    want = torch.empty(3, n)
    packed_kernels.kquant_mm(xb.float(), w, int(qtype), want)
    got, got16 = torch.empty(3, n), torch.empty(3, n, dtype=torch.bfloat16)
    packed_kernels.kquant_mm(xb, w, int(qtype), got)
    packed_kernels.kquant_mm(xb, w, int(qtype), got16)
    assert torch.equal(got, want) and torch.equal(got16, want.bfloat16())
