"""The commands README.md and the documents under docs/ show, read from their text, so the tests run
what a reader copies.

A command is a line of a ```bash block, or a line of another fenced block that starts with the
prompt ``$ `` (a transcript: the lines after it are output). Continuation lines (``\\``) are joined,
``# comments`` dropped and ``a && b`` split into two commands.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"


def documents() -> list[Path]:
    """README.md, then every Markdown file under docs/, in name order."""
    return [README, *sorted(DOCS.glob("*.md"))]


def commands(text: str | None = None) -> list[list[str]]:
    """Every command in ``text``, or in the README and the docs (:func:`documents`), as argument lists,
    in the order they appear."""
    if text is None:
        return [c for path in documents() for c in commands(path.read_text())]
    lines = text.splitlines()
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
    """Which test runs a command of the README or the docs: ``install`` (the environment the suite runs in), ``suite``
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


def _prose(text: str) -> list[str]:
    """The lines of ``text`` outside fenced blocks."""
    out, fenced = [], False
    for line in text.splitlines():
        if line.strip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            out.append(line)
    return out


def anchors(text: str) -> set[str]:
    """The anchors GitHub gives the headings of ``text``: lower case, punctuation but ``-`` and ``_``
    dropped, spaces as ``-``, a repeated heading numbered ``-1``, ``-2``, ..."""
    seen: dict[str, int] = {}
    out = set()
    for line in _prose(text):
        m = re.match(r"#{1,6} +(.*?) *#*$", line)
        if not m:
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(1).lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def links(text: str) -> list[str]:
    """The targets of the Markdown links in ``text``'s prose (not in fenced blocks)."""
    return re.findall(r"\]\(([^)\s]+)\)", "\n".join(_prose(text)))
