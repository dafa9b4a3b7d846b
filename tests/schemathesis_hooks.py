"""schemathesis hooks for tests/schemathesis.sh (SCHEMATHESIS_HOOKS).

schemathesis validates JSON and SSE bodies against docs/openapi.yaml but
has no reader for NDJSON (the streaming exec and attach answers), so it
would skip them. This check validates each line of an NDJSON body against
the schema the spec gives that status and media type (a StreamEvent).
"""

import json

import jsonschema_rs
import schemathesis

NDJSON = "application/x-ndjson"
_validators = {}


def _validator(raw_schema, schema):
    key = json.dumps(schema, sort_keys=True)
    if key not in _validators:
        # The line's schema, resolved within the whole spec (its $refs).
        root = {"$ref": "#/$defs/line", "$defs": {"line": schema}, "components": raw_schema.get("components", {})}
        _validators[key] = jsonschema_rs.Draft202012Validator(root)
    return _validators[key]


@schemathesis.check
def ndjson_event_conformance(ctx, response, case):
    """Every line of an NDJSON body is valid JSON matching the documented schema."""
    ctype = (response.headers.get("content-type") or [""])[0].split(";")[0].strip().lower()
    if ctype != NDJSON:
        return None
    responses = case.operation.definition.raw.get("responses", {})
    doc = responses.get(str(response.status_code)) or responses.get("default")
    if doc is None:
        return None  # status_code_conformance reports it
    raw_schema = case.operation.schema.raw_schema
    if "$ref" in doc:
        name = doc["$ref"].rsplit("/", 1)[-1]
        doc = raw_schema["components"]["responses"][name]
    schema = doc.get("content", {}).get(NDJSON, {}).get("schema")
    if schema is None:
        return None  # content_type_conformance reports it
    validator = _validator(raw_schema, schema)
    for n, line in enumerate(response.content.splitlines(), 1):
        if not line.strip():
            continue
        try:
            event = json.loads(line)
        except ValueError as e:
            raise AssertionError(f"NDJSON line {n} is not JSON ({e}): {line[:200]!r}")
        errors = [e.message for e in validator.iter_errors(event)]
        if errors:
            raise AssertionError(f"NDJSON line {n} violates the schema: {'; '.join(errors)}\n{line[:500]!r}")
    return None
