"""The event loop's own cost at 64, 256 and 1,024 streams over real HTTP, with a null runner
and a tiny-weights runner, next to a bare aiohttp server (same as `asyncengine bench overhead`):

    python benchmarks/loop_overhead.py [--streams 64 256 1024] [--tokens 256]
"""

from __future__ import annotations

import argparse

from asyncengine.entrypoints.bench import overhead

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    overhead.add_arguments(parser)
    raise SystemExit(overhead.main(parser.parse_args()))
