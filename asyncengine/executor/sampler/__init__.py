"""Batched sampling (``sampler.py``) over a step's ``SamplingBatch`` (``batch.py``), with logit
processing (``processing.py``), counter-based seeded noise (``noise.py``) and logprobs
(``logprobs.py``)."""

from asyncengine.executor.sampler.batch import Penalties, SamplingBatch, SamplingRow
from asyncengine.executor.sampler.logprobs import compute_logprobs, prompt_logprobs
from asyncengine.executor.sampler.noise import reference_uniform, seeded_uniform
from asyncengine.executor.sampler.processing import apply_top_k, apply_top_p, process_logits
from asyncengine.executor.sampler.sampler import NO_TOKEN, SamplerOutput, sample, sample_ids

__all__ = ["NO_TOKEN", "Penalties", "SamplerOutput", "SamplingBatch", "SamplingRow",
           "apply_top_k", "apply_top_p", "compute_logprobs", "process_logits",
           "prompt_logprobs", "reference_uniform", "sample", "sample_ids", "seeded_uniform"]
