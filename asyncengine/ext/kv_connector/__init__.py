"""KV connectors: the contract (``contract.py``), the engine's side of it (``transfer.py``: load
before a step, save after it) and the built-in safetensors block store (``safetensors.py``)."""
