"""Own C++ kernels for the CPU, compiled at first use (``build.py``); their sources are in
the top-level ``kernels/`` folder (``kernels/README.md``).

- ``packed.py``: matmuls that read packed int4 / int8 weights in place (GGUF Q4 / Q8_0).
- ``layer_ops.py``: the decoder layer's small ops fused one call each: RMSNorm with its
  residual add, RoPE in place, SiLU(gate) * up, the KV-cache write, and decode attention that
  reads the paged cache in place.
- ``cuda_layer_ops.py``: on CUDA, the same small ops (RMSNorm with its residual add, RoPE,
  SiLU(gate) * up) as FlashInfer's fused kernels, compiled by its JIT at start-up.
"""
