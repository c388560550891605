"""llama-server's own routes: ``/completion``, ``/props`` (``completion.py``) and ``/infill``."""
