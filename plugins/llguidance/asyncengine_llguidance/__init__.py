"""llguidance as an asyncengine structured-output backend: ``--structured-output-backend
llguidance`` (and the fallback of ``auto`` for schemas xgrammar does not enforce).

The class is ``asyncengine_llguidance.backend.LLGuidanceBackend`` (not imported here, so that
loading the plugin does not import llguidance).
"""
