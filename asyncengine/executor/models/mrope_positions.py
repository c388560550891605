"""M-RoPE positions of a prompt (Qwen2-VL, Qwen2.5-VL): computed once per request when its
prompt is prepared (off the loop, with its images), read by the runner per step
(``executor/step/mrope_rows.py``). numpy only.

Each token has three positions (temporal, height, width). A text token's three are equal
and one more than the token before it; an image's placeholders (a grid of ``t x h x w``
merged patches) take the position after the text before them plus their own grid
coordinates, and the text after the image goes on from the image's largest position plus
one (transformers' ``get_rope_index``). So past the prompt every token is at its sequence
index plus one ``delta`` on all three streams (a decode step needs no table).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, eq=False)
class RopePositions:
    """``table``: the prompt's positions ``[3, P]`` (int64); a token at sequence index
    ``i >= P`` is at ``i + delta`` on every stream."""

    table: np.ndarray
    delta: int


def rope_positions(length: int, images: list[tuple[int, int, int, int]]) -> RopePositions:
    """The positions of a prompt of ``length`` tokens whose images' placeholders start at
    ``offset``, each a grid of ``(t, h, w)`` merged patches laid out frame by frame, row by
    row: ``images`` as ``(offset, t, h, w)``, in prompt order."""
    table = np.empty((3, length), dtype=np.int64)
    pos = at = 0  # the next text position; the next sequence index
    for offset, t, h, w in images:
        n = t * h * w
        if offset < at or offset + n > length:
            raise ValueError(f"an image's {n} placeholders at {offset} do not fit the prompt")
        table[:, at:offset] = np.arange(pos, pos + offset - at)
        pos += offset - at
        grid = np.indices((t, h, w)).reshape(3, n)
        table[:, offset:offset + n] = grid + pos
        pos += max(t, h, w)  # (the image's largest position plus one)
        at = offset + n
    table[:, at:] = np.arange(pos, pos + length - at)
    delta = int(table.max()) + 1 - length if length else 0
    return RopePositions(table, delta)
