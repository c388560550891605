"""Counter-based random numbers for seeded requests: ``u = hash(seed, position[, token])``.

A seeded request must sample the same tokens alone and in any batch. A ``torch.Generator`` per
row does that at the cost of one generator and one kernel launch per seeded row per step;
hashing (seed, output position) gives every seeded row its uniforms in one vectorized
expression, whatever the number of seeded rows. The hash is SplitMix64's finalizer in int64
arithmetic (two's-complement wrap-around, as torch's int64 multiply does on every device);
``tests/executor/test_sampler.py`` checks it against an exact Python implementation.
"""

from __future__ import annotations

import torch

_MASK64 = (1 << 64) - 1


def _signed(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x


_GOLDEN = _signed(0x9E3779B97F4A7C15)
_M1 = _signed(0xBF58476D1CE4E5B9)
_M2 = _signed(0x94D049BB133111EB)


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 values."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def splitmix64(x: torch.Tensor) -> torch.Tensor:
    """SplitMix64 of int64 values (bit patterns of uint64)."""
    x = x + _GOLDEN
    x = (x ^ _shr(x, 30)) * _M1
    x = (x ^ _shr(x, 27)) * _M2
    return x ^ _shr(x, 31)


def seeded_uniform(seeds: torch.Tensor, counters: torch.Tensor,
                   width: int | None = None) -> torch.Tensor:
    """Uniforms in (0, 1), float32: ``[K]`` (one per row), or ``[K, width]`` (one per row and
    token) when ``width`` is given. ``seeds`` and ``counters`` are int64 ``[K]``."""
    x = splitmix64(splitmix64(seeds) + counters)
    if width is not None:
        x = splitmix64(x[:, None] + torch.arange(width, device=x.device))
    # The top 23 bits, centred in their interval (exact in float32): never exactly 0 or 1.
    return (_shr(x, 41).to(torch.float32) + 0.5) * (1.0 / (1 << 23))


def reference_uniform(seed: int, counter: int, token: int | None = None) -> float:
    """:func:`seeded_uniform` in exact integer arithmetic (for tests)."""

    def mix(v: int) -> int:
        v = (v + 0x9E3779B97F4A7C15) & _MASK64
        v = ((v ^ (v >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        v = ((v ^ (v >> 27)) * 0x94D049BB133111EB) & _MASK64
        return v ^ (v >> 31)

    x = mix((mix(seed & _MASK64) + counter) & _MASK64)
    if token is not None:
        x = mix((x + token) & _MASK64)
    return ((x >> 41) + 0.5) / (1 << 23)
