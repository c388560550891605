"""The device runtime: what runs a step off the loop and tells the loop it is done.

``device.py`` (the CPU's worker thread and CUDA's stream behind one ``Device``),
``cuda_await.py`` (a CUDA event awaited by the loop), ``staging.py`` (a step's host arrays to
device tensors: ``from_numpy`` on the CPU, one pinned upload on CUDA), ``thread_policy.py``
and ``cpu_malloc.py`` (who gets the CPU's cores, and its heap between steps), ``cpu_flags.py``
(what the CPU has), ``prewarm.py`` (FlashInfer's kernels compiled ahead of time).
Without a GPU: ``simulated.py`` (a CUDA stream and its events), ``flashinfer_standin.py``
(FlashInfer's API on the CPU) and ``simulated_gpu.py`` (an engine on its GPU path over them,
CUDA graphs emulated; a model whose forward pass only takes the stream's time), for the
tests and ``asyncengine bench host``."""
