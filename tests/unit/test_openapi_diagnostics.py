"""/openapi.json names the diagnostics payloads of seeds 000-002 (ClusterTimelineRunner,
RunnerSupervisorDiagnostics, ClusterDiagnostics), and each schema carries every field of the seed with its JSON
type and enum values: a client generated from the document reads the payloads the node sends."""

from __future__ import annotations

from typing import Any

import pytest

from skulk.api.app import create_app

from . import seed_fields as seeds
from .factories import api_services

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def schemas() -> dict[str, Any]:
    return create_app(api_services()).openapi()["components"]["schemas"]


def _resolve(schema: dict[str, Any], schemas: dict[str, Any]) -> list[dict[str, Any]]:
    """The alternatives a schema allows, references followed (anyOf/oneOf/allOf flattened)."""
    if "$ref" in schema:
        return _resolve(schemas[schema["$ref"].rsplit("/", 1)[1]], schemas)
    for key in ("anyOf", "oneOf", "allOf"):
        if key in schema:
            return [alt for part in schema[key] for alt in _resolve(part, schemas)]
    return [schema]


def _problems(schema: dict[str, Any], spec: dict[str, seeds.F], schemas: dict[str, Any], path: str) -> list[str]:
    found: list[str] = []
    (obj,) = [s for s in _resolve(schema, schemas) if s.get("type") == "object" or "properties" in s]
    properties = obj.get("properties", {})
    for name, field in spec.items():
        where = f"{path}.{name}"
        if name not in properties:
            found.append(f"{where}: missing")
            continue
        alternatives = _resolve(properties[name], schemas)
        types = {a.get("type") for a in alternatives}
        if field.type not in types and not (field.type == "number" and "integer" in types) and {} not in alternatives:
            found.append(f"{where}: {field.type} in the seed, {sorted(t for t in types if t)} in the schema")
        enums = {v for a in alternatives for v in a.get("enum", [])}
        if field.enum and enums and not set(field.enum) <= enums:
            found.append(f"{where}: enum lacks {sorted(set(field.enum) - enums)}")
        if field.sub is not None:
            typed = [a for a in alternatives if a.get("type") == field.type]
            inner = typed[0] if typed else alternatives[0]
            if field.type == "array":
                inner = inner.get("items", {})
            if field.type == "object" and "additionalProperties" in inner and "properties" not in inner:
                inner = inner["additionalProperties"]
            found += _problems(inner, field.sub, schemas, where)
    return found


@pytest.mark.parametrize(("name", "spec"), [
    ("ClusterTimelineRunner", seeds.CLUSTER_TIMELINE_RUNNER),
    ("RunnerSupervisorDiagnostics", seeds.RUNNER_SUPERVISOR_DIAGNOSTICS),
    ("ClusterDiagnostics", seeds.CLUSTER_DIAGNOSTICS),
])
def test_the_seed_payloads_are_named_schemas_with_every_field(
    schemas: dict[str, Any], name: str, spec: dict[str, seeds.F]
) -> None:
    assert name in schemas, f"/openapi.json has no {name} schema"
    assert _problems(schemas[name], spec, schemas, name) == []
