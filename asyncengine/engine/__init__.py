"""The engine: the step loop (``engine.py``), emission (``output_processor.py``), the
per-request streams, the outputs handed to callers, and the offline ``LLM``."""
