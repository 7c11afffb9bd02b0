"""A request's `response_format`, read once at parse: the contract its answers must meet.

`json_schema`: `response_format.json_schema.schema` must be a valid JSON Schema (checked against its
own dialect's metaschema, Draft 2020-12 when it names none), at most `MAX_SCHEMA_NODES` values and
`MAX_SCHEMA_DEPTH` levels deep, with local `$ref`s only (`#...`: nothing is ever fetched). Anything
else is a `SchemaRefused` naming the field, raised before any reservation or engine call.
`json_object`: the answer must parse as a JSON object. Any other type (`text`, vLLM's `structural_tag`): no contract.
The engine gets the field as the client sent it: vLLM and SGLang read it for guided decoding.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Final

import orjson
from jsonschema import Draft202012Validator, validators
from jsonschema.exceptions import SchemaError
from jsonschema.protocols import Validator

#: Bounds of a schema, so its check and every answer's validation stay cheap on the event loop.
MAX_SCHEMA_NODES: Final = 5_000
MAX_SCHEMA_DEPTH: Final = 32

PARAM = "response_format"
SCHEMA_PARAM = "response_format.json_schema.schema"


class SchemaRefused(Exception):
    """A response_format the gateway cannot hold answers to (HTTP 400, `param` the field)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.message, self.param = message, param


@dataclass(frozen=True, slots=True)
class Contract:
    """What an answer must be: a JSON object (`validator` None), or valid against a schema."""

    kind: str                      # "json_schema" | "json_object"
    validator: Validator | None


def _walk(node: Any, depth: int, count: list[int]) -> None:
    """Count the schema's values and check its depth and `$ref`s, without recursion past the bound."""
    count[0] += 1
    if count[0] > MAX_SCHEMA_NODES:
        raise SchemaRefused(f"{SCHEMA_PARAM}: more than {MAX_SCHEMA_NODES} values", SCHEMA_PARAM)
    if depth > MAX_SCHEMA_DEPTH:
        raise SchemaRefused(f"{SCHEMA_PARAM}: nested deeper than {MAX_SCHEMA_DEPTH} levels", SCHEMA_PARAM)
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and not ref.startswith("#"):
            raise SchemaRefused(f"{SCHEMA_PARAM}: $ref {ref[:80]!r} is not local ('#...'); the gateway "
                                "fetches no schema", SCHEMA_PARAM)
        for value in node.values():
            _walk(value, depth + 1, count)
    elif isinstance(node, list):
        for value in node:
            _walk(value, depth + 1, count)


def schema_validator(schema: Any) -> Validator:
    """A validator of `schema`, or SchemaRefused naming the first metaschema violation."""
    if not isinstance(schema, dict | bool):
        raise SchemaRefused(f"{SCHEMA_PARAM}: a JSON Schema (an object) is required", SCHEMA_PARAM)
    _walk(schema, 0, [0])
    return _checked(orjson.dumps(schema, option=orjson.OPT_SORT_KEYS))


@functools.lru_cache(maxsize=256)
def _checked(canonical: bytes) -> Validator:
    """The metaschema check costs ~0.8 ms; clients send the same few schemas, so it runs once each."""
    schema = orjson.loads(canonical)
    cls = validators.validator_for(schema, default=Draft202012Validator)
    try:
        cls.check_schema(schema)
    except SchemaError as exc:
        where = exc.json_path if exc.path else "$"
        raise SchemaRefused(f"{SCHEMA_PARAM} is not a valid JSON Schema: {where}: {exc.message[:200]}",
                            SCHEMA_PARAM) from None
    return cls(schema)


def contract_of(response_format: Any) -> Contract | None:
    """The contract a request's `response_format` sets, None when it sets none."""
    if response_format is None:
        return None
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind == "json_object":
        return Contract(kind, None)
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise SchemaRefused(f"{PARAM}: type json_schema needs json_schema.schema", f"{PARAM}.json_schema")
        return Contract(kind, schema_validator(spec["schema"]))
    return None  # text, structural_tag, ...: the engine judges them; the gateway checks nothing
