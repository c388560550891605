"""Offline output tokens/s of asyncengine next to transformers' generate (same run, same
prompts, same dtype). Usage: python benchmarks/throughput.py [--batch-sizes 1 8 32] [--dtype ...]
"""

from __future__ import annotations

import argparse

from asyncengine.entrypoints.bench import throughput as bench_throughput

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    bench_throughput.add_arguments(parser)
    raise SystemExit(bench_throughput.main(parser.parse_args()))
