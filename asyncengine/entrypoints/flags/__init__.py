"""Command-line flags: asyncengine's engine flags (``engine.py``) and server flags
(``server.py``), and the readers of other servers' command lines, vLLM's (``vllm.py``) and
llama-server's (``llama_server.py``), over one flag-table reader (``foreign.py``)."""
