"""The default CPU fast paths keep the numbers: small-batch matmuls, RoPE in four kernels."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from asyncengine.executor.models.rope import RotaryEmbedding, apply_rope
from asyncengine.executor.models.small_matmul import SMALL_ROWS, small_matmuls


def test_small_matmuls_round_like_the_exact_product():
    gen = torch.Generator().manual_seed(0)
    w = (torch.randn(3072, 576, generator=gen) * 0.05).bfloat16()
    x = torch.randn(SMALL_ROWS, 576, generator=gen).bfloat16()
    exact = (x.double() @ w.double().t()).bfloat16()
    with small_matmuls(x):
        assert not torch.backends.mkldnn.enabled
        got = F.linear(x, w)
    assert torch.backends.mkldnn.enabled
    # float32 accumulation rounded once: off the exact rounding only at rare near-ties
    assert (got != exact).float().mean().item() < 1e-3
    for other in (x.float(), torch.randn(SMALL_ROWS + 1, 576).bfloat16()):
        with small_matmuls(other):
            assert torch.backends.mkldnn.enabled  # float32, or too many rows: unchanged
    with pytest.raises(RuntimeError), small_matmuls(x):
        raise RuntimeError
    assert torch.backends.mkldnn.enabled


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_equals_the_textbook_rotation_bit_for_bit(dtype):
    from types import SimpleNamespace

    rotary = RotaryEmbedding(SimpleNamespace(rope_theta=10000.0), 64)
    positions = torch.tensor([0, 1, 7, 300, 4095])
    x = torch.randn(5, 12, 64).to(dtype)
    cos, sin = rotary(positions, dtype)
    freqs = positions[:, None].float() * rotary.inv_freq[None, :]
    c, s = freqs.cos().to(dtype)[:, None], freqs.sin().to(dtype)[:, None]
    x1, x2 = x.chunk(2, dim=-1)
    want = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    assert torch.equal(apply_rope(x, cos, sin), want)
    # a strided view (q and k heads inside the fused projection's output) gives the same
    wide = torch.cat((x, torch.zeros(5, 4, 64, dtype=dtype)), dim=1)
    assert torch.equal(apply_rope(wide[:, :12], cos, sin), want)
