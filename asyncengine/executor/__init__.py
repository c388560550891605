"""Everything that touches torch: building the model and the KV cache, the device, the model
runner, the sampler, the attention backends and the model code."""
