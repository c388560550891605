"""schemathesis, as a user runs it (its CLI), against the live server's /openapi.json.

Two bounded runs (``EXAMPLES`` generated cases per operation and phase; the server's context
of 64 tokens caps every generation):

- **positive** (requests the document allows): no 5xx, every response as documented (status,
  content type, headers, schema, each server-sent event), no schemathesis warning (an
  operation that refuses most of what its document allows is one), and every 4xx refused for
  a rule no JSON Schema can state: the prompt's length in tokens against the context, a
  grammar, regex or JSON schema that does not compile, ``min_tokens`` above ``max_tokens``,
  ``seed + n - 1`` past 64 bits, a chat template that refuses the conversation;
- **negative** (requests that break the document): every one refused with a 4xx.

New routes are covered as they land: the run takes every operation of the document but
those of ``EXCLUDED``.
"""

from __future__ import annotations

import collections
import glob
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.robust_utils import assert_idle_and_free, robust_server
from tests.server_utils import ServerProcess

#: Generated cases per operation and phase (coverage, fuzzing): a few hundred per operation
#: over both runs, a few thousand in all.
EXAMPLES = 50
#: Generous: each run is a few thousand requests (about a minute each on 2 quiet cores).
pytestmark = pytest.mark.timeout(1800)
#: What a positive case may be refused for: the rules a JSON Schema cannot state.
INEXPRESSIBLE = re.compile("|".join([
    r"maximum context length",  # the prompt's tokens, with max_tokens, against the context
    r"invalid (grammar|regular expression|regex|JSON schema|json schema|choice)",
    r"no output can satisfy",  # a constraint that admits nothing
    r"no valid next token",  # ... found while generating (e.g. a tool name no token spells)
    r"min_tokens .* must not exceed max_tokens",
    r"seed \+ n - 1",
    r"Cannot apply the chat template",
    r"which is not in tools",  # tool_choice naming a function the request's tools lack
    r"must pair 1:1, 1:N or N:N",  # /score's two lists, of lengths that do not pair
    r"tokenizes to no tokens",  # a text of characters the tokenizer drops
    r"structured_outputs|guided_|response_format|text\.format|output_config",
    r"No such file",  # an id naming no stored file: the server's state, not its document
]), re.I)
#: Left out: a batch needs an uploaded JSONL file of requests, which no generated upload is
#: (it is checked when the batch is created), so these would only ever answer 404 or 400.
#: tests/http/test_batch_api.py covers them.
EXCLUDED = r"^(create|retrieve|cancel)_batch$"


@pytest.fixture(scope="module")
def server(tiny_llama) -> ServerProcess:
    return robust_server(tiny_llama)


def schemathesis_run(server: ServerProcess, mode: str, out: Path) -> dict:
    """One CLI run; its JSON report (the HAR of every call is written beside it)."""
    cmd = [sys.executable, "-m", "schemathesis.cli", "run", server.url("/openapi.json"),
           "--mode", mode, "--phases", "coverage,fuzzing", "--max-examples", str(EXAMPLES),
           "--generation-deterministic", "--request-timeout", "300",
           "--max-response-time", "300",  # n up to --max-n on a loaded 2-core machine
           "--checks", "all", "--exclude-checks",
           "positive_data_acceptance,use_after_free,ensure_resource_availability,"
           "ignored_auth,object_level_authorization", "--exclude-operation-id-regex", EXCLUDED,
           "--report", "json,har", "--report-dir", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, cwd=out)
    reports = glob.glob(str(out / "json-*.json"))
    assert reports, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(Path(reports[0]).read_text())
    report["_stdout"] = proc.stdout
    return report


def refusals(out: Path) -> collections.Counter[tuple[str, str]]:
    """(operation, error message) of every 4xx in the run's HAR, but 404s of unknown routes
    and 405s (schemathesis probes undeclared methods)."""
    har = json.loads(Path(glob.glob(str(out / "har-*.json"))[0]).read_text())
    found: collections.Counter[tuple[str, str]] = collections.Counter()
    for entry in har["log"]["entries"]:
        status = entry["response"]["status"]
        if not 400 <= status < 500 or status == 405:
            continue
        text = entry["response"]["content"].get("text", "")
        try:
            message = json.loads(text)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = text
        path = entry["request"]["url"].split("/", 3)[-1].split("?")[0]
        found[(f"{entry['request']['method']} /{path}", message)] += 1
    return found


def check(report: dict) -> None:
    failures = report["failures"]
    warnings = {k: v for k, v in report["warnings"].items() if v}
    summary = report["_stdout"][-4000:]
    assert report["complete"], summary
    assert not failures, summary
    assert not report["errors"], summary
    assert not warnings, (warnings, summary)


def test_positive_cases_are_served_as_documented(server, tmp_path):
    report = schemathesis_run(server, "positive", tmp_path)
    check(report)
    total = report["test_cases"]
    print("\nschemathesis positive:", json.dumps(total))
    unexplained = {k: n for k, n in refusals(tmp_path).items()
                   if not INEXPRESSIBLE.search(k[1])}
    assert not unexplained, "refused, though the document allows it:\n" + "\n".join(
        f"{n}x {op}: {msg[:200]}" for (op, msg), n in list(unexplained.items())[:15])
    assert_idle_and_free(server)


def test_negative_cases_are_refused(server, tmp_path):
    report = schemathesis_run(server, "negative", tmp_path)
    check(report)
    print("\nschemathesis negative:", json.dumps(report["test_cases"]))
    assert_idle_and_free(server)
