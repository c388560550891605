"""The engine's torch-free core: requests, sampling parameters, the scheduler contract and
the built-in schedulers, KV-cache block accounting. Nothing here imports torch."""
