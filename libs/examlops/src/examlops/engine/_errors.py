"""The one error an invalid engine block raises: every issue, each naming field, value, accepted."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any, Final


class _Missing:
    """The value of a field that was required but not given."""

    def __repr__(self) -> str:
        return "(missing)"


MISSING: Final = _Missing()


@dataclass(frozen=True)
class EngineBlockIssue:
    """One problem in an engine block.

    `field` is a dotted path from the block's root (``engine.speculative_decoding.draft_model``),
    `value` the offending value (`MISSING` when absent), `accepted` what the field takes.
    """

    field: str
    value: Any
    message: str
    accepted: tuple[str, ...]

    def line(self) -> str:
        accepted = ", ".join(self.accepted) if self.accepted else "see the engine block reference"
        return f"{self.field or '<block>'}: {self.message} (got {self.value!r}; accepted: {accepted})"

    def under(self, *prefix: str | int) -> EngineBlockIssue:
        """This issue with its field path moved under `prefix` (used when nesting models)."""
        parts = [str(p) for p in prefix if p != ""]
        if self.field:
            parts.append(self.field)
        return replace(self, field=".".join(parts))


class EngineBlockError(ValueError):
    """An engine block (or model file) that must not be served; lists every issue found."""

    def __init__(self, issues: Iterable[EngineBlockIssue], *, source: str | None = None) -> None:
        self.issues: tuple[EngineBlockIssue, ...] = tuple(issues)
        if not self.issues:
            raise ValueError("EngineBlockError needs at least one issue")
        self.source = source
        super().__init__(self.__str__())

    @classmethod
    def single(
        cls, field: str, value: Any, message: str, accepted: Iterable[str], *, source: str | None = None
    ) -> EngineBlockError:
        return cls([EngineBlockIssue(field, value, message, tuple(accepted))], source=source)

    def lines(self) -> list[str]:
        """One line per issue, prefixed with the file when the block came from one."""
        prefix = f"{self.source}: " if self.source else ""
        return [prefix + issue.line() for issue in self.issues]

    def with_source(self, source: str) -> EngineBlockError:
        return EngineBlockError(self.issues, source=source)

    def __str__(self) -> str:
        return "\n".join(self.lines())

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (self.issues, self.source))


def _rebuild(issues: tuple[EngineBlockIssue, ...], source: str | None) -> EngineBlockError:
    return EngineBlockError(issues, source=source)
