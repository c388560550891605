"""Text in and out: the tokenizer (encoding, chat templates, loading) and the incremental
detokenizer with stop strings."""
