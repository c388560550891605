"""Multi-LoRA serving: PEFT adapters read into slot tables (``peft.py``, ``tables.py``), one
batched op per adapted projection (``ops.py``, ``kernels/lora.cpp``), and the registry, CPU
LRU and slot assignment on the loop (``manager.py``). See docs/lora.md."""
