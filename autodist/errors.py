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
        if len(self.problems) == 1:  # one line, as every other bad argument is reported
            super().__init__(f"{head}: {self.problems[0]}")
            return
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


class InitError(AutoDistError, ValueError):
    """A model built on the meta device cannot be initialised as asked (a tensor no initialiser
    writes, an initialiser that writes outside what it was seen to write)."""
def mark_raised_on_every_rank(error: BaseException) -> BaseException:
    """Record that every rank raises ``error`` (or one that names it) at this point: code that
    agreed on the failure first (a collective) says so, and only such errors are reported once."""
    error.raised_on_every_rank = True  # type: ignore[attr-defined]
    return error


def reported_once(error: Exception, *, rank: int) -> Exception:
    """``error`` (an AutoDist error, or a bad argument's ``ValueError``/``TypeError``), raised on every
    rank of a multi-rank job, in the form it leaves AutoDist: the same error (type, message and
    fields: ``except PlanError`` and ``except ValueError`` still catch it) that is also a
    ``SystemExit``. Uncaught, the interpreter then prints no traceback and exits with status 1, and
    prints the message on rank 0 only.

    [Note: one report for N ranks] Under torchrun every rank runs the same script, so a plan that
    does not fit (or a budget nothing fits) fails on every rank at once, and an ordinary exception
    prints one traceback per rank (torch prefixes them ``[rankN]:``) above torchrun's own summary.
    The alternative, a ``sys.excepthook`` of our own, would change how every other exception of the
    process is printed. An uncaught ``SystemExit`` is printed by the interpreter itself: its code
    when that is a string (rank 0: the message), nothing when it is a number (the other ranks: 1).
    Rank 0 prints as soon as the error reaches the top of its script; the other ranks' exit, which
    makes torchrun stop the job, comes after their interpreter has shut down.
    """
    cls = type(error)
    both: type[SystemExit] = type(cls.__name__, (cls, SystemExit), {"__module__": cls.__module__, "__qualname__": cls.__qualname__})
    quiet = both.__new__(both)
    assert isinstance(quiet, cls)  # a SystemExit and a ``cls``: what the checker cannot infer from type()
    quiet.args = error.args
    quiet.__dict__.update(error.__dict__)
    name = cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"
    quiet.code = f"{name}: {error}" if rank == 0 else 1
    return quiet
