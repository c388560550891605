"""GGUF types kept packed (``executor/models/kquants.py``, ``kernels/kquant*.cpp``): every type
dequantizes bit-exactly as the ``gguf`` package's reference does, and the packed matmul equals
a float matmul by those weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncengine.executor.models import kquants

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
@settings(max_examples=12, deadline=None)
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


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K, T.Q5_0, T.Q8_0, T.F16], ids=lambda t: t.name)
@pytest.mark.parametrize("m", [1, 3, 70])
def test_packed_matmul_equals_float_matmul(qtype: T, m: int) -> None:
    rng = np.random.default_rng(int(qtype) * 10 + m)
    k, n = 512, 37
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
    assert ((got - want).abs() / scale).max() < 1e-5
