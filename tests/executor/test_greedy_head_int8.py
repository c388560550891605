"""The int8 screen of the greedy head: the argmax of the exact logits (ties to the lowest id),
whatever the shapes; rows it cannot settle are flagged and settled by the float kernel."""

from __future__ import annotations

import pytest
import torch

from asyncengine.executor.sampler import greedy_head_int8 as g8
from asyncengine.executor.sampler.greedy_head import greedy_from_hidden

pytestmark = pytest.mark.skipif(g8._kernel() is None, reason="no C++ compiler here")


def exact_argmax(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    logits = h.double() @ w.double().t()
    if b is not None:
        logits += b.double()
    return logits.argmax(dim=-1)


@pytest.fixture(autouse=True)
def fresh_cache():
    g8._cache.clear()
    yield
    g8._cache.clear()


@pytest.mark.parametrize("n", [1, 3, 8, 17, 100])
@pytest.mark.parametrize("k,v", [(4, 37), (64, 1000), (68, 4099)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_screen_equals_the_exact_argmax(n, k, v, with_bias):
    g = torch.Generator().manual_seed(n * 1000 + k + v)
    w = torch.randn(v, k, generator=g) * 0.1
    b = torch.randn(v, generator=g) * 0.01 if with_bias else None
    h = torch.randn(n, k, generator=g) * 3
    ids, flagged = g8.greedy_int8(h, w, b, -1, force=True)
    ref = exact_argmax(h, w, b)
    settled = flagged == 0
    assert settled.float().mean() >= 0.8  # what the screen exists for
    assert torch.equal(ids[settled], ref[settled])
    assert torch.equal(greedy_from_hidden(h, w, b), ref)


def test_ties_and_near_ties():
    """Duplicate rows tie exactly (lowest id wins); rows a hair apart, far below the int8
    step, are told apart by the exact check."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(512, 64, generator=g) * 0.1
    h = torch.randn(6, 64, generator=g)
    top = exact_argmax(h, w, None)
    for r in range(3):  # copies of row r's winner after it, and a hair better one before it
        t = int(top[r])
        w[min(t + 1 + r, 511)] = w[t]
    w2 = w.clone()
    hair = 1e-6 * h[4].sign()
    w2[0] = w2[int(top[4])] + hair  # beats the winner of row 4 by ~6e-5 in its logit
    for weights in (w, w2):
        g8._cache.clear()
        ids, flagged = g8.greedy_int8(h, weights, None, -1, force=True)
        ref = exact_argmax(h, weights, None)
        assert not flagged.any()
        assert torch.equal(ids, ref)
    assert int(ids[4]) == 0


def test_rows_it_cannot_settle_are_flagged_and_settled_by_the_float_kernel():
    w = torch.randn(300, 16)
    h = torch.randn(4, 16)
    h[1] = float("nan")
    h[2] = 0.0  # every logit 0: all ids tie, more than the screen keeps
    ids, flagged = g8.greedy_int8(h, w, None, -1, force=True)
    assert flagged.tolist() == [0, 1, 1, 0]
    out = greedy_from_hidden(h, w, no_token=-1)
    ref = exact_argmax(h, w, None)
    assert out[0] == ref[0] and out[3] == ref[3]
    assert out[1] == -1 and out[2] == 0  # NaN: no token; all tied: the lowest id


def test_a_head_it_cannot_screen_is_left_to_the_float_kernel():
    w = torch.randn(100, 8)
    w[5, 3] = float("inf")
    assert g8.greedy_int8(torch.randn(2, 8), w, None, -1, force=True) is None
    assert g8.greedy_int8(torch.randn(2, 6), torch.randn(100, 6), None, -1, force=True) is None
    # A head whose rows mostly get flagged stops being screened after its first rows.
    flat = torch.zeros(64, 8)
    for _ in range(g8.PROBE_ROWS // 16):
        assert g8.greedy_int8(torch.randn(16, 8), flat, None, -1, force=True) is not None
    assert g8.greedy_int8(torch.randn(16, 8), flat, None, -1, force=True) is None


def test_wide_hidden_sizes_are_not_screened_and_heads_are_prepared_in_slices(monkeypatch):
    wide = g8.MAX_HIDDEN + 4
    assert g8.greedy_int8(torch.randn(2, wide), torch.randn(50, wide), None, -1,
                          force=True) is None
    monkeypatch.setattr(g8, "PREPARE_ROWS", 7)  # slices that end mid-block, and a ragged end
    w, h = torch.randn(101, 12), torch.randn(9, 12)
    ids, flagged = g8.greedy_int8(h, w, None, -1, force=True)
    settled = flagged == 0
    assert settled.any() and torch.equal(ids[settled], exact_argmax(h, w, None)[settled])
    head = g8._cache[0]
    assert head.packed.shape == (7, 3, 16, 4) and torch.equal(head.scale[101:], torch.zeros(11))


def test_a_changed_weight_is_prepared_again():
    w = torch.randn(200, 32)
    h = torch.randn(5, 32)
    first, _ = g8.greedy_int8(h, w, None, -1, force=True)
    w.mul_(-1)
    again, _ = g8.greedy_int8(h, w, None, -1, force=True)
    assert torch.equal(again, exact_argmax(h, w, None)) and not torch.equal(first, again)
