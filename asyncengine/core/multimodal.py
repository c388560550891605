"""Images in a prompt, as the scheduler, the KV-cache manager and the runner see them.

An image's tokens are placeholders in the prompt (the image token's id, repeated as many
times as the encoder gives it embeddings); :class:`MMInput` says where they are, what the
encoder reads (``data``: the processor's output, opaque here: no torch in ``core``) and the
image's content hash. The hash keys the encoder's output cache and is part of the
prefix-cache hash of every block the placeholders touch, so two prompts share such a block
only when they hold the same image there.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ImageItem:
    """A decoded image (a PIL RGB image) and the hash of its pixels."""

    image: Any
    hash: bytes


@dataclass(frozen=True, eq=False)
class MMInput:
    """One image of a prompt: placeholders ``[offset, offset + length)``, whose embeddings
    are the encoder's output for ``data`` (row ``i`` for position ``offset + i``)."""

    hash: bytes
    offset: int
    length: int
    data: Any
    # Its placeholders attend to each other both ways (Gemma 3): computed in one step.
    whole: bool = False

    @property
    def end(self) -> int:
        return self.offset + self.length


def chunk_without_split(inputs: list[MMInput], start: int, num_new: int) -> int:
    """A prefill chunk ``[start, start + num_new)`` cut short so that it does not end inside
    an image that must be computed whole (0: not this step; it takes the rest of the image
    or nothing). A scheduler calls it when it cuts a prompt to its budget."""
    end = start + num_new
    for m in inputs:
        if m.whole and m.offset < end < m.end:
            return max(0, m.offset - start)
    return num_new


def block_extra_keys(inputs: list[MMInput], start: int, end: int) -> bytes:
    """The hashes of the images whose placeholders meet positions ``[start, end)``, with
    where they start: what a block's prefix-cache hash adds to its token ids."""
    return b"".join(m.hash + m.offset.to_bytes(8, "little")
                    for m in inputs if m.offset < end and m.end > start)


@dataclass(frozen=True)
class ImageRun:
    """``length`` placeholder tokens in a row whose embeddings are one encoder output (of
    ``data``: what the encoder reads; None where the run is only counted)."""

    length: int
    data: Any = None


#: One image's sequence in a prompt, as its family's processor writes it: pieces of text
#: (a string, or a token id) and runs of placeholders. LLaVA-1.5: one run; Gemma 3: text,
#: a run, text; Idefics3: a run per tile with the tile's row and column tags between.
ImageLayout = tuple["str | int | ImageRun", ...]


def run_hash(image_hash: bytes, index: int, count: int) -> bytes:
    """The content key of an image's ``index``-th run (the image's own when it has one)."""
    if count == 1:
        return image_hash
    return hashlib.blake2b(image_hash + index.to_bytes(4, "little"), digest_size=32).digest()


@dataclass(frozen=True)
class ImagePrompt:
    """A prompt with images: text or token ids holding one image placeholder token per
    image, in order (``AsyncEngine.add_request`` takes it where it takes a prompt)."""

    prompt: str | list[int]
    images: list[ImageItem]
    # A text prompt rendered by a chat template holds its special tokens already.
    add_special_tokens: bool = True
    # The image processor's options for this prompt (a request's ``mm_processor_kwargs``),
    # over the server's ``--mm-processor-kwargs`` key by key.
    processor_kwargs: dict[str, Any] | None = None
