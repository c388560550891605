"""OpenAI's API: chat completions, completions, the Responses API, embeddings."""
