"""What users run: the CLI, the aiohttp OpenAI server, the benchmarks."""
