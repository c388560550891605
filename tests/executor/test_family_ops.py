"""The CPU kernels the families beyond Llama's layout take in both the per-layer path and the
decode stack (Gemma's ``1 + w`` norms in bfloat16, per-head q / k norms, GELU-tanh, partial
rotary, a mixture's routing), against their PyTorch counterparts."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from asyncengine.executor.kernels import layer_ops
from asyncengine.executor.models.rope import RotaryEmbedding, apply_rope
from tests.executor.test_layer_ops import DTYPES, _close

pytestmark = pytest.mark.skipif(
    not layer_ops.ENABLED or layer_ops._kernels(torch.float32) is None,
    reason="the CPU layer kernels do not build here")


@pytest.mark.parametrize("dtype", DTYPES)
def test_gemma_norm_scales_by_one_plus_w_and_per_head_norms(dtype):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(5, 3 * 64, generator=gen).to(dtype)
    w = (torch.randn(64, generator=gen) * 0.1).to(dtype)
    # Gemma's unfolded form: x / rms(x) * (1 + w) in float32, rounded once
    heads = x.view(5, 3, 64)
    want = (F.rms_norm(heads.float(), (64,), eps=1e-6) * (1.0 + w.float())).to(dtype)
    _close(layer_ops.rms_norm(heads, w, 1e-6, offset=1.0), want, dtype)
    # per head of a strided view (q heads of a fused qkv row): each head as its own row
    wide = torch.randn(5, 7 * 64, generator=gen).to(dtype)
    q = wide[:, :3 * 64].view(5, 3, 64)
    got = layer_ops.rms_norm(q, w, 1e-6)
    rows = layer_ops.rms_norm(q.reshape(15, 64), w, 1e-6)
    assert got.shape == (5, 3, 64) and torch.equal(got.reshape(15, 64), rows)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu_tanh_times_up(dtype):
    gen = torch.Generator().manual_seed(2)
    gu = (torch.randn(3, 2 * 40, generator=gen) * 3).to(dtype)  # 40: 16 + 16 + 8 lanes
    gate, up = gu.float().chunk(2, dim=-1)
    want = (F.gelu(gate, approximate="tanh") * up).to(dtype)
    _close(layer_ops.act_mul(gu, "gelu_tanh"), want, dtype)
    assert torch.equal(layer_ops.act_mul(gu, "silu"), layer_ops.silu_mul(gu))


@pytest.mark.parametrize("dtype", DTYPES)
def test_partial_rotary_turns_the_first_dims_of_each_head(dtype):
    config = SimpleNamespace(rope_theta=10000.0, rope_scaling=None)
    rot = RotaryEmbedding(config, 16, rotary_dim=12)  # Phi-4-mini's 3/4 of each head
    cos, sin = rot(torch.tensor([0, 3, 700]), dtype)
    x = torch.randn(3, 5, 16, generator=torch.Generator().manual_seed(3)).to(dtype)
    want = apply_rope(x.clone(), cos, sin)
    got = layer_ops.rope_(x, cos, sin)
    _close(got, want, dtype)
    assert torch.equal(got[..., 12:], want[..., 12:])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("experts", "k", "renormalize", "shared"),
                         [(8, 2, True, False), (4, 3, False, True)])
def test_moe_routing_kernel_routes_as_pytorch_does(dtype, experts, k, renormalize, shared):
    """``moe_route.cpp``: the experts ``SparseMoE.route`` picks, weights within rounding,
    sorted by expert (tokens in order), and the shared expert's gate."""
    from asyncengine.executor.models import moe

    route = moe.route_kernel(dtype)
    if route is None:
        pytest.skip("moe_route.cpp does not build here")
    gen = torch.Generator().manual_seed(4)
    T, H = 9, 64
    x = torch.randn(T, H, generator=gen).to(dtype)
    layer = SimpleNamespace(router=torch.randn(experts, H, generator=gen).to(dtype),
                            top_k=k, renormalize=renormalize, num_experts=experts, hidden=H,
                            shared_expert=object() if shared else None,
                            shared_expert_gate=torch.randn(1, H, generator=gen).to(dtype))
    rows, offs, wts, gate = moe.SparseMoE._route_cpu(layer, route, x)
    weights, chosen = moe.SparseMoE.route(layer, x)
    order = torch.argsort(chosen.reshape(-1), stable=True)
    assert torch.equal(rows, order // k)
    counts = torch.bincount(chosen.reshape(-1), minlength=experts)
    assert torch.equal(offs, torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)]))
    torch.testing.assert_close(wts, weights.reshape(-1)[order], atol=2e-2, rtol=2e-2)
    if shared:
        want = torch.sigmoid(F.linear(x, layer.shared_expert_gate))
        _close(gate, want, dtype)
    else:
        assert gate is None
