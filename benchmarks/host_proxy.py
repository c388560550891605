"""The host's work per step on the CUDA step path against a simulated GPU, by phase, at 1,
32, 256 and 1,024 streams, over HTTP and in-process ``generate()`` (same as `asyncengine
bench host`; docs/gpu.md has its calibration against the H100):

    python benchmarks/host_proxy.py [--streams 1 32 256 1024] [--consumers http generate]
        [--tokens 128] [--t-gpu-ms 3.5] [--json FILE]
"""

from __future__ import annotations

import argparse

from asyncengine.entrypoints.bench import host

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    host.add_arguments(parser)
    raise SystemExit(host.main(parser.parse_args()))
