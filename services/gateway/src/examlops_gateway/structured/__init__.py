"""Structured output: a request's `response_format` schema checked at parse, and every answer
validated against it (STRUCTURED.md). The HTTP wing retries invalid whole answers and maps the
verdicts onto responses (http/_structured.py).
"""

from ._schema import MAX_SCHEMA_DEPTH, MAX_SCHEMA_NODES, Contract, SchemaRefused, contract_of
from ._stage import VERDICT_HEADER, StreamCheck, StructuredOutput
from ._validate import first_failure

__all__ = [
    "MAX_SCHEMA_DEPTH", "MAX_SCHEMA_NODES", "VERDICT_HEADER", "Contract", "SchemaRefused", "StreamCheck",
    "StructuredOutput", "contract_of", "first_failure",
]
