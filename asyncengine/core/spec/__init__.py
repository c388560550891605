"""Speculative decoding, the engine's side: proposing draft tokens between steps (pure
Python, no torch). Verification and acceptance are in ``executor/spec/``."""
