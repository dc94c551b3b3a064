"""Every command README.md shows is run by a test, as written.

``tests/readme.py`` reads the commands from the README's text; each kind runs where it fits:
``torchrun … examples/*.py`` in test_examples.py (fewer steps and a smaller model, by flags appended
to the README's command), ``autodist …`` in test_cli.py (in order, as written), ``pip install`` is the
environment this suite runs in and ``python -m pytest`` is this suite (CI runs the README's test
command verbatim: .ci/run). The developer tools (``python tools/*.py``) run for minutes; here they
parse and check the README's arguments (models and contenders exist), as they do before launching.
"""

import importlib.util
import sys
from pathlib import Path

import pytest

import readme

ROOT = Path(__file__).resolve().parents[1]


def test_every_readme_command_is_run_by_a_test():
    commands = readme.commands()
    assert not [c for c in commands if readme.kind(c) is None]
    assert {readme.kind(c) for c in commands} == {"install", "suite", "example", "autodist", "tool"}


def test_commands_are_read_from_bash_blocks_and_prompted_transcripts():
    text = "```bash\npip install x && torchrun a.py \\\n  --n 2   # two\n```\n```\n$ autodist env\noutput\n```\n```python\nf()\n```\n"
    assert readme.commands(text) == [["pip", "install", "x"], ["torchrun", "a.py", "--n", "2"], ["autodist", "env"]]


def _tool(path: str, monkeypatch):
    name = f"readme_tool_{Path(path).stem}"
    spec = importlib.util.spec_from_file_location(name, ROOT / path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the tools put the repository on sys.path
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("argv", readme.of_kind("tool"), ids=lambda a: " ".join(a[1:])[:60])
def test_the_tools_accept_the_readme_arguments(argv, monkeypatch):
    args = _tool(argv[1], monkeypatch).parse_args(argv[2:])
    assert not getattr(args, "worker", False)  # the tool parent side, not a rank
