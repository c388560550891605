"""The errors the engine raises to its callers."""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The step loop failed (a broken device); the request cannot finish."""


class EngineShuttingDown(RuntimeError):
    """The engine no longer accepts requests (draining or stopped)."""


class EngineOverloaded(RuntimeError):
    """The waiting queue is full (``--max-queued-requests``): retry later."""


class RequestFailed(RuntimeError):
    """This request, and only it, could not go on: its grammar, its detokenization, or a row of
    logits with no valid token. The message names the cause; other requests are unaffected."""
