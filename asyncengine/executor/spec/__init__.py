"""Speculative decoding, the device's side: verifying draft tokens (``accept.py``)."""
