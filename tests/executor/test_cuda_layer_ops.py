"""FlashInfer's fused layer ops (``executor/kernels/cuda_layer_ops.py``) on the CPU, through
the stand-in modules of ``runtime/flashinfer_standin.py`` (FlashInfer's documented semantics:
float32, one rounding): which op each layer calls, in place where FlashInfer works in place, and a
bfloat16 model's logits through them as close to its float32 logits as the PyTorch path's.
That the real kernels agree is for ``tests/gpu/test_gpu.py``'s bfloat16 tests on a GPU."""

from __future__ import annotations

import logging
import types

import pytest
import torch

from asyncengine.executor.kernels import cuda_layer_ops, layer_ops
from asyncengine.executor.models.rope import apply_rope
from asyncengine.executor.runtime.flashinfer_standin import layer_op_modules
from asyncengine.executor.weights.loader import load_model, resolve_model
from tests.executor.test_models import PagedRunner
from tests.utils import make_tiny_model

FAMILIES = ["llama", "qwen3", "gemma2"]


@pytest.fixture
def fake(monkeypatch):
    """(the stand-in flashinfer, its list of calls); the CPU's own kernels off, so that the
    layers reach the CUDA branch; the ops off again after."""
    monkeypatch.setattr(layer_ops, "ENABLED", False)
    calls: list[str] = []
    norm, activation, rope = layer_op_modules(calls)
    yield types.SimpleNamespace(norm=norm, activation=activation, rope=rope), calls
    cuda_layer_ops.disable()


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("layer_ops")
    return {f: make_tiny_model(root / f, f, initializer_range=0.1) for f in FAMILIES}


def _logits(model, tokens: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A prefill of all but the last 4 tokens, then one decode step each: [len, vocab]."""
    runner = PagedRunner(model, block_size=4, dtype=dtype)
    runner.backend.configure_layers(model.attention_options())
    n = len(tokens) - 4
    got = [runner.step({"r": tokens[:n]})["r"]]
    got += [runner.step({"r": tokens[i:i + 1]})["r"] for i in range(n, len(tokens))]
    return torch.cat(got).float()


@pytest.mark.parametrize("family", FAMILIES)
def test_bfloat16_logits_through_the_fused_ops(models, family, fake):
    module, calls = fake
    tokens = torch.randint(0, 49152, (20,), generator=torch.Generator().manual_seed(5))
    want = _logits(load_model(resolve_model(models[family]), "auto", torch.float32, "cpu"),
                   tokens, torch.float32)
    model = load_model(resolve_model(models[family]), "auto", torch.bfloat16, "cpu")
    model.configure_context(64)
    plain = _logits(model, tokens, torch.bfloat16)
    assert not calls
    assert cuda_layer_ops.setup(model, torch.bfloat16, "cpu", 64, module=module)
    calls.clear()
    fused = _logits(model, tokens, torch.bfloat16)

    # as close to float32 as the PyTorch path (which rounds after every op); a greedy token
    # other than float32's only at a near-tie (within that rounding)
    err_plain, err_fused = (want - plain).abs().max(), (want - fused).abs().max()
    assert err_fused <= 1.5 * err_plain + 1e-3, (err_fused, err_plain)
    picked = want.gather(1, fused.argmax(-1, keepdim=True))[:, 0]
    assert (want.max(-1).values - picked).max() <= 2 * err_plain
    assert (fused.argmax(-1) == want.argmax(-1)).float().mean() >= 0.8

    # per layer and step: two norms with their residual adds fused (the first layer's first
    # has no residual), one RoPE over q and k, one activation * up; then the final norm
    layers, steps = model.num_layers, 5
    gemma = family == "gemma2"
    act = "gelu_tanh_and_mul" if gemma else "silu_and_mul"
    fused_norm = "gemma_fused_add_rmsnorm" if gemma else "fused_add_rmsnorm"
    plain_norm = "gemma_rmsnorm" if gemma else "rmsnorm"
    assert calls.count("rope") == layers * steps
    assert calls.count(act) == layers * steps
    # Gemma's sandwich norms: post-attention and post-feed-forward norm without a residual
    sandwich = 2 * layers if gemma else 0
    assert calls.count(fused_norm) == (2 * layers - 1 + 1) * steps
    assert calls.count(plain_norm) == (1 + sandwich) * steps


def test_rope_from_the_table_turns_heads_as_apply_rope_does(models, fake):
    """q and k as views into one qkv row (strided rows), turned in place; against
    ``apply_rope`` in float32."""
    module, calls = fake
    model = load_model(resolve_model(models["llama"]), "auto", torch.float32, "cpu")
    table = model.rotary
    T, hq, hk, D = 6, 4, 2, model.head_dim
    positions = torch.tensor([0, 1, 2, 17, 40, 63])
    qkv = torch.randn(T, (hq + 2 * hk) * D)
    cos, sin = table(positions, torch.float32)
    want = apply_rope(qkv[:, :(hq + hk) * D].reshape(T, hq + hk, D).clone(), cos, sin)
    cuda_layer_ops.prewarm("cpu", torch.float32, module=module)
    table.use_table(64, "cpu")
    rope, none = table(positions, torch.float32)
    assert isinstance(rope, cuda_layer_ops.RopeTable) and none is None
    v = qkv[:, (hq + hk) * D:].clone()
    rope.apply_(qkv[:, :hq * D], qkv[:, hq * D:(hq + hk) * D], D)
    torch.testing.assert_close(qkv[:, :(hq + hk) * D].view(T, hq + hk, D), want)
    assert torch.equal(qkv[:, (hq + hk) * D:], v)  # v untouched


def test_setup_leaves_the_pytorch_path_when_it_should(models, fake, monkeypatch, caplog):
    module, calls = fake
    model = load_model(resolve_model(models["llama"]), "auto", torch.bfloat16, "cpu")
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    # float32: the exact comparisons against transformers keep PyTorch's ops
    assert not cuda_layer_ops.setup(model, torch.float32, "cpu", 64, module=module)
    assert not cuda_layer_ops.usable(x.float())
    # turned off for a comparison
    monkeypatch.setenv(cuda_layer_ops.ENV, "0")
    assert not cuda_layer_ops.setup(model, torch.bfloat16, "cpu", 64, module=module)
    monkeypatch.delenv(cuda_layer_ops.ENV)
    # the JIT fails: one warning, the PyTorch path
    broken = types.SimpleNamespace(**vars(module))
    broken.norm = types.SimpleNamespace(**vars(module.norm))

    def fail(*a, **k):
        raise RuntimeError("nvcc: error: unsupported architecture\nmore")

    broken.norm.rmsnorm = fail
    with caplog.at_level(logging.WARNING, logger="asyncengine"):
        assert not cuda_layer_ops.setup(model, torch.bfloat16, "cpu", 64, module=broken)
    assert not cuda_layer_ops.usable(x)
    assert "RuntimeError: nvcc: error: unsupported architecture" in caplog.text
    assert all(t.cos_sin is None for t in model.ropes.values())
    # and on: bfloat16 on the device it was set up for, not under another
    assert cuda_layer_ops.setup(model, torch.bfloat16, "cpu", 64, module=module)
    assert cuda_layer_ops.usable(x) and not cuda_layer_ops.usable(x.float())
    assert cuda_layer_ops.has_activation("silu") and not cuda_layer_ops.has_activation("gelu_tanh")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("head_dim", [64, 128])
def test_flashinfer_layer_ops_on_the_gpu(head_dim):
    """The real kernels against the stand-ins' float32 semantics, in bfloat16 on the GPU:
    norms with and without the residual add (both forms), both activations, RoPE on q and k
    views into one qkv (strided rows) at positions up to 4k."""
    pytest.importorskip("flashinfer")
    import flashinfer

    bf16, dev = torch.bfloat16, "cuda"
    try:
        cuda_layer_ops.prewarm(dev, bf16, tuple(cuda_layer_ops.ACTIVATIONS))
        ref_norm, ref_act, ref_rope = layer_op_modules()
        close = dict(rtol=1.6e-2, atol=1.6e-2)  # two bfloat16 steps of 2**-7
        T, N = 7, 2048
        x = torch.randn(T, N, dtype=bf16, device=dev)
        res = torch.randn(T, N, dtype=bf16, device=dev)
        w = (1 + 0.1 * torch.randn(N, device=dev)).to(bf16)
        for gemma in (False, True):
            ref = ref_norm.gemma_rmsnorm if gemma else ref_norm.rmsnorm
            torch.testing.assert_close(cuda_layer_ops.rms_norm(x, w, 1e-5, gemma=gemma),
                                       ref(x, w, 1e-5), **close)
            a, r = x.clone(), res.clone()
            out, r_out = cuda_layer_ops.rms_norm(a, w, 1e-5, r, gemma=gemma)
            assert out.data_ptr() == a.data_ptr() and r_out.data_ptr() == r.data_ptr()
            torch.testing.assert_close(r_out, (x.float() + res.float()).to(bf16), **close)
            torch.testing.assert_close(out, ref(r_out, w, 1e-5), **close)
        gate_up = torch.randn(T, 2 * N, dtype=bf16, device=dev)
        for name, fn in cuda_layer_ops.ACTIVATIONS.items():
            torch.testing.assert_close(cuda_layer_ops.act_mul(gate_up, name),
                                       getattr(ref_act, fn)(gate_up), **close)
        hq, hk = 32, 8
        qkv = torch.randn(T, (hq + 2 * hk) * head_dim, dtype=bf16, device=dev)
        want = qkv.clone()
        positions = torch.tensor([0, 1, 5, 100, 1000, 2047, 4095], device=dev)
        inv_freq = 1.0 / (500000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
        table = cuda_layer_ops.cos_sin_table(inv_freq, 1.0, 4096, dev)
        q, k = slice(0, hq * head_dim), slice(hq * head_dim, (hq + hk) * head_dim)
        ref_rope.apply_rope_with_cos_sin_cache_inplace(positions, want[:, q], want[:, k],
                                                       head_dim, table)
        cuda_layer_ops.RopeTable(positions, table).apply_(qkv[:, q], qkv[:, k], head_dim)
        torch.testing.assert_close(qkv, want, **close)
        assert flashinfer.__version__
    finally:
        cuda_layer_ops.disable()
