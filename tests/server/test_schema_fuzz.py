"""schemathesis against /openapi.json on a live loopback server: no request the schema allows may cause a 5xx."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from tests.server.conftest import ThreadServer, engine_factory, make_state

EXAMPLES_PER_OPERATION = 30


@pytest.fixture(scope="module")
def fuzz_server(tiny_text_model: Path) -> Iterator[ThreadServer]:
    # A short context bounds the work any single fuzzed request can ask for.
    server = ThreadServer(make_state(engine_factory(tiny_text_model, max_model_len=48, max_num_seqs=4)))
    yield server
    server.stop()


@pytest.mark.slow
def test_no_server_errors(fuzz_server: ThreadServer) -> None:
    schema = schemathesis.openapi.from_url(fuzz_server.url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health"}
    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, suppress_health_check=list(HealthCheck),
                  database=None)
        def check(case: Any) -> None:
            response = case.call(timeout=60)
            assert response.status_code < 500, (case.method, case.path, response.status_code, response.text[:500])
            if response.status_code >= 400:  # every error leaves in the OpenAI shape
                assert set(response.json()) == {"error"}

        check()
