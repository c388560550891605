"""Structured outputs: the backend contract (``contract.py``), the manager the engine uses
(``manager.py``) and the default backend, xgrammar (``xgrammar.py``, imported on use)."""

from asyncengine.ext.structured_output.contract import (
    KINDS,
    STRUCTURED_OUTPUT_API_VERSION,
    Grammar,
    StructuredOutputBackend,
    fill_rows,
)
from asyncengine.ext.structured_output.manager import StructuredOutputManager

__all__ = ["KINDS", "STRUCTURED_OUTPUT_API_VERSION", "Grammar", "StructuredOutputBackend",
           "StructuredOutputManager", "fill_rows"]
