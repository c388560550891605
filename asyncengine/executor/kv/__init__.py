"""The paged KV cache on the device: its dtype (``dtype.py``: float8 storage and its
conversions), its size in blocks from the memory left (``sizing.py``), and whole blocks copied
out and in for KV connectors (``blocks.py``). Which blocks a request holds is ``core/kv/``."""
