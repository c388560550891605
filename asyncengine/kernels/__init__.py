"""Attention backends. ``get_attention_backend(name)`` returns an instance."""

from __future__ import annotations

from asyncengine.kernels.base import AttentionBackend, AttentionMetadata


def get_attention_backend(name: str = "auto", device: str = "cpu") -> AttentionBackend:
    if name == "auto":
        name = "torch_paged"
        if device.startswith("cuda"):
            try:
                import flashinfer  # noqa: F401

                name = "flashinfer"
            except ImportError:
                pass
    if name == "torch_paged":
        from asyncengine.kernels.torch_paged import TorchPagedBackend

        return TorchPagedBackend()
    if name == "flashinfer":
        from asyncengine.kernels.flashinfer import FlashInferBackend

        return FlashInferBackend()
    raise ValueError(f"--attention-backend: unknown backend {name!r} (allowed: auto, "
                     "torch_paged, flashinfer)")


__all__ = ["AttentionBackend", "AttentionMetadata", "get_attention_backend"]
