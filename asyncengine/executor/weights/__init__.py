"""Weights: where they come from and how they are kept.

- ``loader.py``: a model source (a directory, a file, the hub, the embedded model) into a
  :class:`~asyncengine.executor.models.CausalLM`, from safetensors, GGUF or ``dummy``;
- ``gguf_header.py``, ``gguf_arch.py``, ``gguf.py``: GGUF's header, its architectures' names,
  its tensors; ``hub_access.py``, ``hub_gguf.py``: the model hub;
- ``checkpoint_quant.py``, ``checkpoint_packed.py``: quantized checkpoints (FP8, AWQ, GPTQ);
- ``quantization.py`` (``--quantization``), ``int4.py``, ``kquants.py``, ``kquant_paths.py``:
  packed weights and the linears that multiply them in place.
"""
