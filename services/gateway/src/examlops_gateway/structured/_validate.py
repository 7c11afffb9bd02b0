"""Whether an answer meets its contract, and if not, the first failing JSON path, for a person.

The path and reason are jsonschema's `best_match` (the error deepest in the answer that explains
it), as `$.population: 'many' is not of type 'integer'`. Only the answer's own text is quoted,
truncated: it is the caller's answer, never someone else's data.
"""

from __future__ import annotations

from typing import Any

import orjson
from jsonschema.exceptions import best_match

from ._schema import Contract

_QUOTE = 120  # longest excerpt of the answer quoted in a message


def _short(text: str) -> str:
    return text if len(text) <= _QUOTE else text[:_QUOTE] + "..."


def first_failure(contract: Contract, text: str | None) -> str | None:
    """None when `text` meets the contract; else `<JSON path>: <reason>`."""
    if text is None:
        return "$: the answer has no content"
    try:
        doc: Any = orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        return f"$: not valid JSON (at character {exc.pos}): {_short(text)!r}"
    if contract.validator is None:
        return None if isinstance(doc, dict) else f"$: {_short(text)!r} is not a JSON object"
    error = best_match(contract.validator.iter_errors(doc))
    if error is None:
        return None
    return f"{error.json_path}: {_short(error.message)}"


def choice_failure(contract: Contract, index: int, text: str | None, finish_reason: Any, choices: int) -> str | None:
    """first_failure of one choice, prefixed with its index when there are several, and saying so
    when the engine stopped at the output bound (the usual cause of JSON cut short)."""
    failure = first_failure(contract, text)
    if failure is None:
        return None
    if finish_reason == "length":
        failure += " (the answer stopped at max_tokens)"
    return f"choices[{index}]: {failure}" if choices > 1 else failure
