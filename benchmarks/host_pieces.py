"""Where a step's fixed host work goes: ``asyncengine bench host``'s engine with the pieces of
``runner.prepare`` and ``runner.execute`` timed one by one.

    python benchmarks/host_pieces.py --streams 1 --consumers batch --tokens 1000

takes ``bench host``'s flags, runs it, then prints each timed piece's wall time per step (the
loop thread's, as it runs there; a wrapped call costs ~0.3 µs more) and its calls per step.
A piece's time includes the pieces it calls.
"""

from __future__ import annotations

import argparse
import collections
import functools
import sys
import time
from typing import Any

from asyncengine.entrypoints.bench import host
from asyncengine.executor import runner as runner_module
from asyncengine.executor.attention.flashinfer import FlashInferBackend
from asyncengine.executor.paths import cuda_graphs
from asyncengine.executor.runtime.staging import PinnedStaging

PIECES: list[tuple[Any, str]] = [
    (runner_module.ModelRunner, "prepare"), (runner_module.ModelRunner, "execute"),
    (runner_module, "gather_rows"), (runner_module, "gather_sampling_batch"),
    (FlashInferBackend, "prepare"), (FlashInferBackend, "plan"),
    (PinnedStaging, "begin"), (PinnedStaging, "put"), (PinnedStaging, "flush"),
    (cuda_graphs.CUDAGraphRunner, "run"), (cuda_graphs, "fill_static"),
    (runner_module.ModelRunner, "_sampling_logits"), (runner_module, "sample_ids"),
    (runner_module, "pending_output"),
]


def timed(owner: Any, name: str, spent: collections.Counter, calls: collections.Counter
          ) -> None:
    fn = getattr(owner, name)
    label = f"{getattr(owner, '__name__', owner).rsplit('.', 1)[-1]}.{name}"

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter_ns()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[label] += time.perf_counter_ns() - start
            calls[label] += 1

    setattr(owner, name, wrapper)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    host.add_arguments(parser)
    args = parser.parse_args(argv)
    spent: collections.Counter = collections.Counter()
    calls: collections.Counter = collections.Counter()
    for owner, name in PIECES:
        timed(owner, name, spent, calls)
    rc = host.main(args)
    steps = calls["ModelRunner.prepare"] or 1
    print(f"\n{'piece':40s} {'us/step':>9s} {'calls/step':>11s}")
    for label, ns in sorted(spent.items(), key=lambda kv: -kv[1]):
        print(f"{label:40s} {ns / steps / 1e3:9.1f} {calls[label] / steps:11.1f}")
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
