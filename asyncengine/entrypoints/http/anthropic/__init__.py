"""Anthropic's Messages API (``/v1/messages``), over the chat machinery of ``openai/``."""
