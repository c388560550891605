"""asyncengine next to llama.cpp's llama-server and vLLM's CPU build on the same streamed load,
one after another in one run, with the ratios (same as `asyncengine bench peers`); peers that
are not installed are reported as such. How to build them: docs/benchmarks.md.

    python benchmarks/peers.py [--concurrency 1 32] [--llama-server PATH] [--hf-model DIR]
"""

from __future__ import annotations

import argparse

from asyncengine.entrypoints.bench import peers

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    peers.add_arguments(parser)
    raise SystemExit(peers.main(parser.parse_args()))
