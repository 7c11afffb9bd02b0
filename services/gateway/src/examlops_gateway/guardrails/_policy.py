"""Guardrail policies: a named list of detector entries, validated with errors that name the field.

An entry says which detector runs (`pii`, `secrets`, `regex`, `model`), on which direction
(`input`, `output`, `both`) and what a finding does (`block`, `redact`, `log`). A `model` entry
names a route used as a judge; its route may not exist yet when the policy is set (it is looked up
when used, and a judge that cannot answer blocks unless `on_error: allow`).
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Any

from ._detectors import DetectorConfigError, build_detector

DIRECTIONS = ("input", "output", "both")
ACTIONS = ("block", "redact", "log")
DETECTORS = ("pii", "secrets", "regex", "model")
ON_ERROR = ("block", "allow")
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
MAX_ENTRIES = 32
DEFAULT_JUDGE_TIMEOUT_S = 5.0


class PolicyError(ValueError):
    """A policy is wrong; `field` names where (`detectors[1].entities`)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass(frozen=True, slots=True)
class Entry:
    detector: str
    direction: str
    action: str
    entities: tuple[str, ...] = ()
    pattern: str | None = None
    route: str | None = None
    timeout_s: float = DEFAULT_JUDGE_TIMEOUT_S
    on_error: str = "block"

    def applies(self, direction: str) -> bool:
        return self.direction in (direction, "both")

    def as_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["entities"] = list(self.entities)
        if self.detector != "model":
            for name in ("route", "timeout_s", "on_error"):
                out.pop(name)
        return {k: v for k, v in out.items() if v not in (None, [])}


@dataclass(frozen=True, slots=True)
class Policy:
    name: str
    entries: tuple[Entry, ...]

    def as_json(self) -> dict[str, Any]:
        return {"name": self.name, "detectors": [e.as_json() for e in self.entries]}


def check_name(name: str, field: str = "name") -> str:
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise PolicyError(field, f"{str(name)[:70]!r} is not a policy name (letters, digits, '.', '_', '-'; "
                                 "at most 64)")
    return name


def _choice(raw: dict[str, Any], name: str, allowed: tuple[str, ...], where: str, default: str | None = None) -> str:
    value = raw.get(name, default)
    if value not in allowed:
        raise PolicyError(f"{where}.{name}", f"{value!r} is not one of {', '.join(allowed)}")
    return str(value)


def parse_entry(raw: Any, where: str) -> Entry:
    """One detector entry; PolicyError names the field (`detectors[0].pattern`)."""
    if not isinstance(raw, dict):
        raise PolicyError(where, "a detector entry is an object")
    unknown = set(raw) - {"detector", "entities", "pattern", "route", "timeout_s", "on_error", "direction", "action"}
    if unknown:
        raise PolicyError(f"{where}.{sorted(unknown)[0]}", "unknown field")
    detector = _choice(raw, "detector", DETECTORS, where)
    direction = _choice(raw, "direction", DIRECTIONS, where)
    action = _choice(raw, "action", ACTIONS, where)
    entities = raw.get("entities") or []
    if not isinstance(entities, list) or not all(isinstance(e, str) for e in entities):
        raise PolicyError(f"{where}.entities", "a list of entity names")
    pattern = raw.get("pattern")
    if detector == "model":
        return _model_entry(raw, where, direction, action, entities, pattern)
    for name in ("route", "timeout_s", "on_error"):
        if raw.get(name) is not None:
            raise PolicyError(f"{where}.{name}", "only a model detector takes it")
    try:
        build_detector(detector, entities or None, pattern)
    except DetectorConfigError as exc:  # its message starts with the field's name
        field, _, message = str(exc).partition(": ")
        raise PolicyError(f"{where}.{field}", message or str(exc)) from None
    return Entry(detector=detector, direction=direction, action=action, entities=tuple(entities), pattern=pattern)


def _model_entry(raw: dict[str, Any], where: str, direction: str, action: str, entities: list[str],
                 pattern: Any) -> Entry:
    if pattern is not None or entities:
        raise PolicyError(f"{where}.{'pattern' if pattern is not None else 'entities'}",
                          "a model detector takes a route, not patterns or entities")
    route = raw.get("route")
    if not isinstance(route, str) or not route:
        raise PolicyError(f"{where}.route", "a model detector needs the route of its judge")
    if action == "redact":
        raise PolicyError(f"{where}.action", "a model judge gives a verdict, not spans: block or log")
    timeout = raw.get("timeout_s", DEFAULT_JUDGE_TIMEOUT_S)
    if not isinstance(timeout, int | float) or isinstance(timeout, bool) or not 0 < timeout <= 120:
        raise PolicyError(f"{where}.timeout_s", "seconds, more than 0 and at most 120")
    on_error = _choice(raw, "on_error", ON_ERROR, where, "block")
    return Entry(detector="model", direction=direction, action=action, route=route, timeout_s=float(timeout),
                 on_error=on_error)


def parse_policy(name: str, raw: Any) -> Policy:
    """A policy from its JSON (`{"detectors": [...]}`), or PolicyError naming the field."""
    check_name(name)
    if not isinstance(raw, dict):
        raise PolicyError("detectors", "a policy is an object with a `detectors` list")
    entries = raw.get("detectors")
    if not isinstance(entries, list) or not 1 <= len(entries) <= MAX_ENTRIES:
        raise PolicyError("detectors", f"a list of 1 to {MAX_ENTRIES} detector entries")
    return Policy(name, tuple(parse_entry(e, f"detectors[{i}]") for i, e in enumerate(entries)))
