"""Every command README.md and docs/*.md show is run by a test, as written, and every link between
them leads somewhere.

``tests/readme.py`` reads the commands from their text; each kind runs where it fits:
``torchrun … examples/*.py`` in test_examples.py (fewer steps and a smaller model, by flags appended
to the README's command), ``autodist …`` in test_cli.py (in order, as written; ``autodist check`` with flags appended for a
smaller batch and fewer plans and steps), ``pip install`` is the
environment this suite runs in and ``python -m pytest`` is this suite (CI runs the README's test
command verbatim: .ci/run). The developer tools (``python tools/*.py``) run for minutes; here they
parse and check the README's arguments (models and contenders exist), as they do before launching.
"""

import importlib.util
import re
import sys
from pathlib import Path

import pytest

import readme

ROOT = Path(__file__).resolve().parents[1]


def test_every_readme_command_is_run_by_a_test():
    commands = readme.commands()
    assert not [c for c in commands if readme.kind(c) is None]
    assert {readme.kind(c) for c in commands} == {"install", "suite", "example", "autodist", "tool"}


def test_the_docs_commands_are_read_with_the_readme_s():
    docs = [p.name for p in readme.documents()[1:]]
    assert "design.md" in docs and "usage.md" in docs and "cli.md" in docs
    cli = (readme.DOCS / "cli.md").read_text()
    assert readme.commands(cli)[0][:2] == ["autodist", "plan"]
    assert all(c in readme.commands() for c in readme.commands(cli))


def test_every_document_under_docs_is_linked_from_the_readme():
    linked = {t.split("#")[0] for t in readme.links(readme.README.read_text())}
    assert {f"docs/{p.name}" for p in readme.documents()[1:]} <= linked


@pytest.mark.parametrize("path", readme.documents(), ids=lambda p: p.name)
def test_every_relative_link_leads_to_a_file_and_heading_that_exist(path):
    broken = []
    for target in readme.links(path.read_text()):
        if re.match(r"[a-z]+:", target):
            continue  # a URL
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            broken.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in readme.anchors(dest.read_text()):
            broken.append(target)
    assert not broken, f"{path.name}: links to nothing: {broken}"


def test_anchors_are_github_s():
    text = "# A\n## What `plan=\"auto\"` does\n```\n# not a heading\n```\n## `autodist check`: on your model\n## A\n"
    assert readme.anchors(text) == {"a", "what-planauto-does", "autodist-check-on-your-model", "a-1"}


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
