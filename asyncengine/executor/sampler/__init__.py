"""Batched sampling (``sampler.py``) over a step's ``SamplingBatch`` (``batch.py``), with logit
processing (``processing.py``) and logprobs (``logprobs.py``)."""

from asyncengine.executor.sampler.batch import SamplingBatch, SamplingRow, make_generator
from asyncengine.executor.sampler.logprobs import compute_logprobs, prompt_logprobs
from asyncengine.executor.sampler.processing import apply_top_k, apply_top_p, process_logits
from asyncengine.executor.sampler.sampler import SamplerOutput, sample, sample_ids

__all__ = ["SamplerOutput", "SamplingBatch", "SamplingRow", "apply_top_k", "apply_top_p",
           "compute_logprobs", "make_generator", "process_logits", "prompt_logprobs", "sample",
           "sample_ids"]
