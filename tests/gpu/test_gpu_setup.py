"""GPU start-up decisions, on the CPU: KV-cache sizing from a profile and
--gpu-memory-utilization (vLLM's meaning), the profiling forward pass itself, bfloat16 by
default on CUDA, and which attention backend --attention-backend picks where."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from asyncengine.config import EngineConfig
from asyncengine.executor import build as build_module
from asyncengine.executor.attention import get_attention_backend, resolve_backend_name
from asyncengine.executor.attention.prewarm import prewarm_attention
from asyncengine.executor.attention.torch_paged import TorchPagedBackend
from asyncengine.executor.kv import sizing as kv_sizing
from asyncengine.executor.kv.sizing import (
    GIB,
    MemorySnapshot,
    check_free_memory,
    dummy_forward,
    kv_blocks_for_budget,
    kv_cache_budget,
)
from asyncengine.executor.weights.loader import load_model, pick_dtype, resolve_model

MIB = 1 << 20


def test_kv_budget_is_the_utilization_share_of_total_memory_minus_the_profile():
    # An 80 GiB GPU at 0.9: 72 GiB for the engine; 16.5 GiB peak in torch (weights and
    # activations), 1.5 GiB outside torch: 54 GiB for the KV cache.
    assert kv_cache_budget(80 * GIB, 0.9, int(16.5 * GIB), int(1.5 * GIB)) == 54 * GIB
    assert kv_cache_budget(80 * GIB, 0.5, 50 * GIB, 0) < 0  # nothing left


def test_kv_blocks_for_a_budget():
    per_block = 2 * MIB  # e.g. 16 layers x 2 x 16 tokens x 8 heads x 64 dims x 2 bytes x 8
    assert kv_blocks_for_budget(10 * GIB, per_block, 16, 8192) == 5120
    assert kv_blocks_for_budget(10 * GIB, per_block, 16, 8192, extra_blocks=1) == 5119
    # 1 GiB holds 512 blocks of 16 tokens; an 8192-token request needs 512: just enough.
    assert kv_blocks_for_budget(GIB, per_block, 16, 8192) == 512
    with pytest.raises(ValueError, match="--gpu-memory-utilization.*513 blocks.*--max-model-len"):
        kv_blocks_for_budget(GIB, per_block, 16, 8193)
    with pytest.raises(ValueError, match="--gpu-memory-utilization: 0.00 GiB"):
        kv_blocks_for_budget(kv_cache_budget(24 * GIB, 0.5, 13 * GIB, 0), per_block, 16, 2048)
    with pytest.raises(ValueError, match="--kv-cache-memory"):
        kv_blocks_for_budget(MIB, per_block, 16, 2048, flag="--kv-cache-memory")


def test_the_engines_share_must_be_free_at_start():
    check_free_memory(MemorySnapshot(free=70 * GIB, total=80 * GIB, reserved=0), 0.85)
    with pytest.raises(ValueError, match="--gpu-memory-utilization 0.9.*72.00 GiB.*70.00 GiB"):
        check_free_memory(MemorySnapshot(free=70 * GIB, total=80 * GIB, reserved=0), 0.9)
    assert MemorySnapshot(free=60 * GIB, total=80 * GIB, reserved=15 * GIB).non_torch == 5 * GIB


def test_build_sizes_the_cuda_kv_cache_from_the_profile(monkeypatch):
    """build's CUDA branch: the profile's numbers, --gpu-memory-utilization, the backend's
    scratch block, and the flag named when nothing is left."""
    config = EngineConfig.from_dict({"gpu_memory_utilization": 0.5, "block_size": 16})
    model = SimpleNamespace(num_layers=16, num_kv_heads=8, head_dim=64)
    backend = TorchPagedBackend()
    backend.extra_kv_blocks = 1
    device = torch.device("cpu")  # the profile is stubbed: where it would run
    at_start = MemorySnapshot(free=40 * GIB, total=40 * GIB, reserved=0)
    monkeypatch.setattr(kv_sizing, "profile_cuda_memory",
                        lambda *a, **k: (15 * GIB, GIB))  # peak in torch, outside torch
    per_block = backend.bytes_per_block(16, 16, 8, 64, torch.bfloat16)  # 512 KiB
    blocks = kv_sizing.num_kv_blocks(config, model, backend, torch.bfloat16, device, 4096,
                                      at_start)
    assert blocks == (20 * GIB - 16 * GIB) // per_block - 1
    monkeypatch.setattr(kv_sizing, "profile_cuda_memory", lambda *a, **k: (19 * GIB, GIB))
    with pytest.raises(ValueError, match="--gpu-memory-utilization"):
        kv_sizing.num_kv_blocks(config, model, backend, torch.bfloat16, device, 4096, at_start)


def test_profiling_forward_runs_on_the_cpu(tiny_llama):
    """The profiling step (a full --max-num-batched-tokens prefill over several requests, then
    the sampler and logprobs at --max-num-seqs rows) builds valid inputs for a real model."""
    source = resolve_model(tiny_llama)
    model = load_model(source, "auto", torch.float32, "cpu").eval()
    kv_bytes = dummy_forward(model, TorchPagedBackend(), 8, num_tokens=100, num_seqs=7,
                             max_sample_rows=7, dtype=torch.float32, device="cpu")
    blocks = sum((n + 7) // 8 for n in [15, 15, 14, 14, 14, 14, 14])  # 100 tokens in 7
    assert kv_bytes == model.num_layers * blocks * 2 * 8 * model.num_kv_heads * \
        model.head_dim * 4


def test_auto_dtype_is_bfloat16_on_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert pick_dtype("auto", "cuda") == torch.bfloat16
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    assert pick_dtype("auto", "cuda") == torch.float16  # pre-Ampere GPUs
    assert pick_dtype("float32", "cuda") == torch.float32


def test_attention_backend_choice():
    assert resolve_backend_name("auto", "cuda", torch.bfloat16, True) == "flashinfer"
    assert resolve_backend_name("auto", "cuda", torch.float16, True) == "flashinfer"
    assert resolve_backend_name("auto", "cuda", torch.float32, True) == "torch_paged"
    assert resolve_backend_name("auto", "cuda", torch.bfloat16, False) == "torch_paged"
    assert resolve_backend_name("auto", "cpu", torch.bfloat16, True) == "torch_paged"
    assert resolve_backend_name("torch_paged", "cuda", torch.bfloat16, True) == "torch_paged"
    with pytest.raises(ValueError, match="--attention-backend flashinfer.*not installed"):
        resolve_backend_name("flashinfer", "cuda", torch.bfloat16, False)
    with pytest.raises(ValueError, match="--attention-backend flashinfer.*float32"):
        resolve_backend_name("flashinfer", "cuda", torch.float32, True)
    with pytest.raises(ValueError, match="--attention-backend flashinfer.*CUDA"):
        resolve_backend_name("flashinfer", "cpu", torch.bfloat16, True)
    with pytest.raises(ValueError, match="--attention-backend"):
        resolve_backend_name("flash", "cuda", torch.bfloat16, True)
    # Here (no CUDA, no flashinfer): auto is torch_paged; asking for flashinfer is an error.
    assert isinstance(get_attention_backend("auto", "cpu"), TorchPagedBackend)
    with pytest.raises(ValueError, match="--attention-backend flashinfer"):
        get_attention_backend("flashinfer", "cpu")


def test_no_silent_fallback_one_warning_names_the_reason(caplog):
    """auto on CUDA that cannot use FlashInfer logs ONE warning naming why; the explicit flag
    raises a ValueError naming it; head dims other than 64/128/256 never reach FlashInfer."""
    import logging

    def auto(*args) -> tuple[str, list[str]]:
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="asyncengine"):
            name = resolve_backend_name("auto", "cuda", *args)
        return name, [r.getMessage() for r in caplog.records]

    assert auto(torch.bfloat16, True, 128) == ("flashinfer", [])
    assert auto(torch.bfloat16, True, 64)[0] == "flashinfer"
    assert auto(torch.float16, True, 256)[0] == "flashinfer"
    name, warnings = auto(torch.bfloat16, "ImportError: libcudart.so.13 missing", 128)
    assert name == "torch_paged" and len(warnings) == 1
    assert "flashinfer" in warnings[0] and "libcudart.so.13 missing" in warnings[0]
    name, warnings = auto(torch.bfloat16, True, 32)
    assert name == "torch_paged" and len(warnings) == 1 and "head_dim" in warnings[0] \
        and "32" in warnings[0]
    name, warnings = auto(torch.float32, True, 64)
    assert name == "torch_paged" and len(warnings) == 1 and "float32" in warnings[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="asyncengine"):
        assert resolve_backend_name("auto", "cpu", torch.bfloat16, False, 16) == "torch_paged"
    assert caplog.records == []  # the CPU never had FlashInfer: nothing to warn about
    with pytest.raises(ValueError, match="--attention-backend flashinfer.*head_dim.*48"):
        resolve_backend_name("flashinfer", "cuda", torch.bfloat16, True, 48)
    with pytest.raises(ValueError, match="--attention-backend flashinfer.*import failed: boom"):
        resolve_backend_name("flashinfer", "cuda", torch.bfloat16, "boom", 64)


class _FailingPrewarm(TorchPagedBackend):
    name = "flashinfer"

    def prewarm(self, graphs: bool = True) -> float:
        raise RuntimeError("nvcc: batch_prefill.cu: fatal error\nmore lines")


def test_a_jit_failure_is_a_warning_under_auto_and_an_error_when_asked_for(caplog):
    import logging

    model = SimpleNamespace(attention_options=lambda: [])
    auto = EngineConfig.from_dict({})
    with caplog.at_level(logging.WARNING, logger="asyncengine"):
        backend = prewarm_attention(auto, _FailingPrewarm(), model)
    assert backend.name == "torch_paged"
    (record,) = caplog.records
    assert "torch_paged, not flashinfer" in record.getMessage()
    assert "batch_prefill.cu: fatal error" in record.getMessage()
    explicit = EngineConfig.from_dict({"attention_backend": "flashinfer"})
    with pytest.raises(ValueError, match="--attention-backend flashinfer.*fatal error"):
        prewarm_attention(explicit, _FailingPrewarm(), model)


def test_sampling_backend_falls_back_with_one_warning(monkeypatch, caplog):
    import logging
    import sys

    from asyncengine.executor.runtime.cuda_device import CUDADevice
    from asyncengine.executor.runtime.device import Device
    from asyncengine.executor.runtime.flashinfer_standin import make_module
    from asyncengine.executor.runtime.simulated import SimulatedCUDA

    class CUDAOnHost(CUDADevice):  # CUDA's start-up choices, its tensors in host memory
        torch_device = torch.device("cpu")

    cuda = CUDAOnHost(cuda=SimulatedCUDA())
    fi, sampling = make_module()
    monkeypatch.setitem(sys.modules, "flashinfer", fi)
    monkeypatch.setitem(sys.modules, "flashinfer.sampling", sampling)
    assert cuda.sampling_method(64) == "flashinfer"
    assert [c[0] for c in sampling.calls] == ["plain", "top_p", "top_k", "top_k_top_p"]

    def broken(*a, **k):
        raise RuntimeError("ninja: build stopped: subcommand failed")

    sampling.sampling_from_logits = broken
    with caplog.at_level(logging.WARNING, logger="asyncengine"):
        assert cuda.sampling_method(64) is None
    (record,) = caplog.records
    assert "sampling backend torch, not flashinfer" in record.getMessage()
    assert "subcommand failed" in record.getMessage()
    assert Device().sampling_method(64) is None


def test_backends_in_use_are_on_metrics():
    from asyncengine.engine.metrics import EngineMetrics

    runner = SimpleNamespace(attn_backend=SimpleNamespace(name="flashinfer"),
                             sampling_method="flashinfer")
    names = build_module.backend_names(runner)
    assert names == {"attention": "flashinfer", "sampling": "flashinfer"}
    text = EngineMetrics("m", backends=names).render().decode()
    assert 'asyncengine:attention_backend_info{backend="flashinfer"} 1.0' in text
    assert 'asyncengine:sampling_backend_info{backend="flashinfer"} 1.0' in text
    cpu = SimpleNamespace(attn_backend=TorchPagedBackend(), sampling_method=None)
    assert build_module.backend_names(cpu) == {"attention": "torch_paged", "sampling": "torch"}


def test_gpu_flags_reach_the_config():
    config = EngineConfig.from_dict({"enforce_eager": True, "attention_backend": "flashinfer",
                                     "gpu_memory_utilization": 0.8})
    assert config.model.enforce_eager and config.device.attention_backend == "flashinfer"
    with pytest.raises(ValueError, match="--gpu-memory-utilization"):
        EngineConfig.from_dict({"gpu_memory_utilization": 1.5})


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without CUDA")
def test_gpu_benchmark_says_it_needs_a_gpu():
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu.py"
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and "needs a CUDA GPU" in r.stderr and r.stdout == ""


def test_prewarm_command_compiles_each_spec_then_sampling():
    """`python -m asyncengine.executor.runtime.prewarm` (what `make gpu-check` runs first): every
    spec's prefill, decode and graph-mode decode kernels, then sampling, then LoRA's segment
    GEMM, then the fused layer ops, driven through the stand-in module on the CPU."""
    from asyncengine.executor.runtime import prewarm
    from asyncengine.executor.runtime.flashinfer_standin import make_module

    fi, sampling = make_module()
    specs = prewarm.parse_specs("64,256+window+softcap,128+tc")
    assert specs == [prewarm.KernelSpec(64), prewarm.KernelSpec(256, False, True, True),
                     prewarm.KernelSpec(128, tensor_cores=True)]
    assert specs[2].heads == (8, 1)  # a GQA group > 4: FlashInfer's tensor-core decode
    lines: list[str] = []
    took = prewarm.prewarm_specs(specs, dtype=torch.float32, device="cpu", module=fi,
                                 sampling_module=sampling, log=lines.append)
    assert list(took) == [str(s) for s in specs] + [
        "sampling", "lora segment gemm", "layer ops norm", "layer ops rope",
        "layer ops activation"]
    assert fi.norm.calls == ["rmsnorm", "fused_add_rmsnorm", "gemma_rmsnorm",
                             "gemma_fused_add_rmsnorm", "rope", "silu_and_mul",
                             "gelu_tanh_and_mul"]
    assert "head_dim 256, window, soft cap" in lines[1]
    assert [c[0] for c in sampling.calls] == ["plain", "top_p", "top_k", "top_k_top_p"]
    with pytest.raises(ValueError, match="--specs"):
        prewarm.parse_specs("64+fast")
    # One part each, for processes side by side (make gpu-session).
    sampling.calls.clear()
    assert list(prewarm.prewarm_specs(specs, dtype=torch.float32, device="cpu", module=fi,
                                      sampling_module=sampling, parts=["sampling"],
                                      log=lines.append)) == ["sampling"]
    assert len(sampling.calls) == 4
    assert list(prewarm.prewarm_specs(specs[:1], dtype=torch.float32, device="cpu", module=fi,
                                      sampling_module=sampling, parts=["attention"],
                                      log=lines.append)) == ["head_dim 64"]


def test_prewarm_command_dry_run_and_without_a_gpu(capsys):
    from asyncengine.executor.runtime import prewarm

    assert prewarm.main(["--dry-run"]) == 0
    out = capsys.readouterr().out
    assert out.count("would compile: attention") == len(prewarm.DEFAULT_SPECS)
    assert "sampling" in out
    assert prewarm.main(["--dry-run", "--parts", "lora"]) == 0
    assert capsys.readouterr().out == "would compile: LoRA segment GEMM (bfloat16)\n"
    assert prewarm.main(["--dry-run", "--parts", "norm,rope"]) == 0
    assert capsys.readouterr().out == ("would compile: layer ops, norm (bfloat16)\n"
                                       "would compile: layer ops, rope (bfloat16)\n")
    with pytest.raises(SystemExit) as e:
        prewarm.main(["--parts", "attention,kv"])
    assert e.value.code == 2 and "--parts: kv" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        prewarm.main(["--specs", "64+bogus"])
    assert e.value.code == 2 and "--specs" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert prewarm.main([]) == 2
        assert "needs a CUDA GPU" in capsys.readouterr().err
