"""Exceptions raised by AutoDist. Each message names what was wrong and what to do about it."""

from __future__ import annotations


class AutoDistError(RuntimeError):
    """Base class for AutoDist errors."""


class PlanError(AutoDistError, ValueError):
    """A plan (object or file) is malformed or does not fit the model it is applied to.

    ``problems`` lists every violation found, one human-readable line each.
    """

    def __init__(self, problems: list[str] | str, *, source: str | None = None) -> None:
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        self.source = source
        head = f"invalid plan{f' {source}' if source else ''}"
        shown = self.problems[:12]
        more = len(self.problems) - len(shown)
        body = "\n  - ".join(shown)
        tail = f"\n  (and {more} more)" if more > 0 else ""
        super().__init__(f"{head}:\n  - {body}{tail}")


class BudgetError(AutoDistError):
    """No plan fits the memory budget."""


class RankMismatchError(AutoDistError):
    """Ranks disagree about something that must be identical (plan hash, parameter order)."""


class PeerFailure(AutoDistError):
    """Another rank failed or exited while this one waited for a collective with it."""
