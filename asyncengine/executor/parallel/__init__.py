"""Tensor parallelism (``--tensor-parallel-size``): see docs/architecture.md."""
