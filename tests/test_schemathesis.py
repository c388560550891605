"""schemathesis against /openapi.json: requests generated from the document (valid ones, and
ones that break it) never get a 5xx, every response matches the documented status, content
type, headers and schema (each server-sent event of a stream too), and the server is healthy
with every KV block free afterwards."""

from __future__ import annotations

import collections

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from tests.robust_utils import assert_idle_and_free, robust_server
from tests.server_utils import ServerProcess

#: Examples per operation and mode: about 400 requests in all, in well under a minute.
EXAMPLES = 25
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
          response_headers_conformance, response_schema_conformance]


@pytest.fixture(scope="module")
def server(tiny_llama) -> ServerProcess:
    return robust_server(tiny_llama)


def fuzz(server: ServerProcess, op, mode: GenerationMode, session: requests.Session,
         statuses: collections.Counter, failures: list[str]) -> None:
    """Run ``EXAMPLES`` generated cases of one operation; record statuses and failures."""
    # Bodies that break the schema must be refused, not served.
    checks = CHECKS + ([negative_data_rejection] if mode == GenerationMode.NEGATIVE else [])

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    @given(case=op.as_strategy(generation_mode=mode))
    def run(case) -> None:
        response = case.call(base_url=server.base_url, session=session, timeout=60)
        statuses[(op.label, mode.value, response.status_code)] += 1
        try:
            case.validate_response(response, checks=checks)
        except BaseException as e:  # schemathesis raises an exception group
            failures.append(f"{op.label} ({mode.value}): {e}")

    try:
        run()
    except Unsatisfiable:  # nothing to break in a request without a body or parameters
        assert mode == GenerationMode.NEGATIVE


def test_openapi_document_holds_under_schemathesis(server):
    schema = schemathesis.openapi.from_url(server.url("/openapi.json"))
    session = requests.Session()
    statuses: collections.Counter[tuple[str, str, int]] = collections.Counter()
    failures: list[str] = []
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {"POST /v1/completions", "POST /v1/chat/completions", "POST /v1/messages",
            "POST /v1/messages/count_tokens"} <= {op.label for op in operations}
    for op in operations:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            fuzz(server, op, mode, session, statuses, failures)
    total = sum(statuses.values())
    print(f"\nschemathesis: {total} requests, {len(failures)} failures")
    for key, count in sorted(statuses.items()):
        print(f"  {key[0]} {key[1]} -> {key[2]}: {count}")
    assert not failures, "\n\n".join(failures[:5])
    assert total > 200
    assert_idle_and_free(server)
