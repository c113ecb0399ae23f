"""A schemathesis run over a real node's /openapi.json: a bounded number of generated requests per operation,
none of which may get a 5xx, a status the operation does not declare, or a body outside the schema declared for
the status it got (every route declares its success body and its error statuses: skulk.api.openapi). Operations
that would stop or reconfigure the node under test (restart, config writes) are left out; everything else,
placement and deletes included, is fair game."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis.specs.openapi.checks import response_schema_conformance, status_code_conformance

from skulk.testing.nodes import LocalNode

from .harness import Cluster

pytestmark = pytest.mark.timeout(120)
EXAMPLES = 3
"""Per operation. Generating the cases is what costs (the node answers each in milliseconds): with ~70
operations this keeps the run near half a minute on two cores."""
LEFT_OUT = r"^/(admin/restart|config)$"
HEALTH_CHECKS: list[HealthCheck] = [HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large]


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalNode]:
    cluster = Cluster(tmp_path_factory.mktemp("fuzz"))
    (started,) = cluster.start(1)
    yield started
    assert cluster.stop_all() == [], "runner processes outlived their node"


def acceptable_status(response: Any) -> bool:
    """No 500 (a bug), and no 5xx without the typed error body. 502/503 say a dependency is unavailable on this
    machine (no route to Hugging Face, no store configured, no instance), in the typed shape; they are answers."""
    if response.status_code < 500:
        return True
    try:
        error = response.json()["error"]
        typed = (isinstance(error, str) and bool(error)) or set(error) >= {"message", "type"}  # Ollama's, ours
    except (ValueError, KeyError, TypeError):
        typed = False
    return response.status_code in (502, 503) and typed


def test_no_5xx_and_no_schema_violation(node: LocalNode) -> None:
    schema = schemathesis.openapi.from_url(node.url + "/openapi.json").exclude(path_regex=LEFT_OUT)
    failures: list[str] = []
    for result in schema.get_all_operations():
        operation = result.ok()  # pyright: ignore[reportAttributeAccessIssue]  (an invalid schema raises here)

        @given(case=operation.as_strategy())
        @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                  suppress_health_check=HEALTH_CHECKS, phases=[Phase.explicit, Phase.generate])
        def exercise(case: schemathesis.Case) -> None:
            response = case.call(timeout=30)
            if not acceptable_status(response):
                failures.append(f"{case.method} {case.formatted_path} {case.body!r:.300}: {response.status_code} "
                                f"{response.text[:200]}")
                return
            try:
                case.validate_response(response, checks=[status_code_conformance, response_schema_conformance])
            except Exception as exc:  # a schema violation: collected, so one run reports them all
                failures.append(f"{case.method} {case.formatted_path}: {str(exc)[:300]}")

        exercise()
    assert not failures, "\n".join(failures) + "\n" + node.log_tail(80)
