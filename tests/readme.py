"""The commands README.md shows, read from its text, so the tests run what a reader copies.

A command is a line of a ```bash block, or a line of another fenced block that starts with the
prompt ``$ `` (a transcript: the lines after it are output). Continuation lines (``\\``) are joined,
``# comments`` dropped and ``a && b`` split into two commands.
"""

from __future__ import annotations

import shlex
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def commands(text: str | None = None) -> list[list[str]]:
    """Every command in the README, as argument lists, in the order they appear."""
    lines = (README.read_text() if text is None else text).splitlines()
    found: list[str] = []
    fence: str | None = None
    pending = ""
    for line in lines:
        stripped = line.strip()
        if stripped.startswith("```"):
            fence = None if fence is not None else stripped[3:].strip()
            continue
        if fence is None:
            continue
        if fence == "bash":
            text_line = stripped
        elif stripped.startswith("$ ") or pending:
            text_line = stripped[2:] if stripped.startswith("$ ") else stripped
        else:
            continue
        if not text_line and not pending:
            continue
        pending += text_line
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        found.append(pending)
        pending = ""
    out: list[list[str]] = []
    for command in found:
        for part in command.split("&&"):
            argv = shlex.split(part, comments=True)
            if argv:
                out.append(argv)
    return out


def with_overrides(argv: list[str], overrides: list[str]) -> list[str]:
    """``argv`` followed by ``overrides``: argparse keeps the last value of a repeated option, so a later
    ``--steps 2`` replaces the README's ``--steps 20`` and everything else stays as written."""
    return [*argv, *overrides]


def kind(argv: list[str]) -> str | None:
    """Which test runs a README command: ``install`` (the environment the suite runs in), ``suite``
    (the suite itself; CI runs the README's test command: .ci/run), ``example`` (test_examples.py),
    ``autodist`` (test_cli.py), ``tool`` (test_readme.py), or ``None``: nothing does."""
    if argv[:2] == ["pip", "install"]:
        return "install"
    if argv[:3] == ["python", "-m", "pytest"]:
        return "suite"
    if argv[0] == "torchrun" and any(a.startswith("examples/") and a.endswith(".py") for a in argv):
        return "example"
    if argv[0] == "autodist":
        return "autodist"
    if argv[0] == "python" and len(argv) > 1 and argv[1].startswith("tools/") and argv[1].endswith(".py"):
        return "tool"
    return None


def of_kind(name: str) -> list[list[str]]:
    return [c for c in commands() if kind(c) == name]
