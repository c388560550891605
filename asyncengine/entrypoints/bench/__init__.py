"""``asyncengine bench ...``: serving and offline throughput benchmarks."""
