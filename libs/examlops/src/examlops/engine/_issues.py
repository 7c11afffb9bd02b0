"""Turn a pydantic ValidationError into EngineBlockIssues that name field, value and accepted."""

from __future__ import annotations

import types
import typing
from collections.abc import Iterator
from typing import Any

import annotated_types
from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo
from pydantic_core import ErrorDetails

from ._errors import MISSING, EngineBlockError, EngineBlockIssue

_TYPE_WORDS = {
    "int": "an integer",
    "float": "a number",
    "bool": "true or false",
    "string": "a string",
    "dict": "a mapping",
    "list": "a list",
    "model": "a mapping",
}


def issues_from_validation_error(
    exc: ValidationError, model: type[BaseModel], *, prefix: str = ""
) -> list[EngineBlockIssue]:
    """Every error of `exc` as issues, with field paths under `prefix`."""
    issues: list[EngineBlockIssue] = []
    for error in exc.errors():
        loc = tuple(error["loc"])
        inner = (error.get("ctx") or {}).get("error")
        if isinstance(inner, EngineBlockError):
            issues.extend(issue.under(prefix, *loc) for issue in inner.issues)
        else:
            issues.append(_issue(error, model, loc).under(prefix))
    return issues


def _issue(error: ErrorDetails, model: type[BaseModel], loc: tuple[str | int, ...]) -> EngineBlockIssue:
    kind = error["type"]
    field = ".".join(str(p) for p in loc if p != "[key]")
    value = MISSING if kind == "missing" else error.get("input")
    if kind == "extra_forbidden":
        owner = _model_at(model, loc[:-1])
        names = tuple(owner.model_fields) if owner is not None else ()
        return EngineBlockIssue(field, value, f"unknown key {loc[-1]!r}", names)
    info = _field_at(model, loc)
    if kind == "literal_error" or kind == "enum":
        choices = _literal_choices(info.annotation) if info is not None else ()
        if "[key]" in loc or not choices:
            expected = (error.get("ctx") or {}).get("expected", "")
            choices = tuple(c.strip(" '") for c in str(expected).replace(" or ", ", ").split(","))
        return EngineBlockIssue(field, value, f"{value!r} is not accepted", choices)
    accepted = (_describe(info),) if info is not None else (_type_word(kind),)
    if kind == "missing":
        return EngineBlockIssue(field, value, "is required", accepted)
    return EngineBlockIssue(field, value, error["msg"], accepted)


def _walk(model: type[BaseModel], loc: tuple[str | int, ...]) -> Iterator[FieldInfo | None]:
    """Yield the FieldInfo of each step of `loc`, following nested models."""
    current: type[BaseModel] | None = model
    for part in loc:
        if current is None or not isinstance(part, str) or part not in current.model_fields:
            yield None
            current = None
            continue
        info = current.model_fields[part]
        yield info
        current = _nested_model(info.annotation)


def _field_at(model: type[BaseModel], loc: tuple[str | int, ...]) -> FieldInfo | None:
    steps = list(_walk(model, loc))
    return steps[-1] if steps else None


def _model_at(model: type[BaseModel], loc: tuple[str | int, ...]) -> type[BaseModel] | None:
    if not loc:
        return model
    info = _field_at(model, loc)
    return _nested_model(info.annotation) if info is not None else None


def _nested_model(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _nested_model(arg)
        if found is not None:
            return found
    return None


def _literal_choices(annotation: Any) -> tuple[str, ...]:
    if typing.get_origin(annotation) is typing.Literal:
        return tuple(str(a) for a in typing.get_args(annotation))
    if typing.get_origin(annotation) not in (typing.Union, types.UnionType):
        return ()
    args = typing.get_args(annotation)
    out = [choice for arg in args for choice in _literal_choices(arg)]
    if out and type(None) in args:
        out.append("null")
    return tuple(out)


def _describe(info: FieldInfo) -> str:
    """A human description of what a field accepts: its type and numeric bounds."""
    choices = _literal_choices(info.annotation)
    if choices:
        return " | ".join(choices)
    bounds = [
        f"{symbol} {getattr(meta, name)}"
        for meta in info.metadata
        if isinstance(meta, annotated_types.BaseMetadata)
        for name, symbol in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<="))
        if getattr(meta, name, None) is not None
    ]
    word, nullable = _annotation_word(info.annotation)
    described = " ".join([word, " and ".join(bounds)]).strip()
    return f"{described}, or null" if nullable else described


def _annotation_word(annotation: Any) -> tuple[str, bool]:
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    nullable = len(args) < len(typing.get_args(annotation))
    base = args[0] if nullable and len(args) == 1 else annotation
    name = {int: "int", float: "float", bool: "bool", str: "string"}.get(base, "")
    if typing.get_origin(base) is dict:
        name = "dict"
    elif typing.get_origin(base) is list:
        name = "list"
    elif _nested_model(base) is not None:
        name = "model"
    return _TYPE_WORDS.get(name, "a value"), nullable


def _type_word(kind: str) -> str:
    return next((w for k, w in _TYPE_WORDS.items() if kind.startswith(k)), "see the reference")
