"""The layering the design promises (issue 13): modelling (``cost/``) never imports the runtime, the
search or the measuring code; the runtime never imports the search; plan construction and the
schedule's rules exist once (``builtins.py``, ``schedule.py``)."""

import ast
import pathlib

PKG = pathlib.Path(__file__).resolve().parents[1] / "autodist"


def _imports(path: pathlib.Path) -> set[str]:
    """The autodist modules ``path`` imports (resolved from relative imports)."""
    here = path.relative_to(PKG.parent).with_suffix("").parts
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = list(here[: len(here) - node.level])
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out.add(mod)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return {m for m in out if m.startswith("autodist")}


def _within(module: str, *packages: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def _package_imports(sub: str) -> dict[str, set[str]]:
    return {str(p.relative_to(PKG)): _imports(p) for p in (PKG / sub).glob("*.py")}


def test_modelling_imports_neither_the_runtime_nor_the_search_nor_measuring():
    for name, mods in _package_imports("cost").items():
        bad = [m for m in mods if _within(m, "autodist.runtime", "autodist.sched", "autodist.measure")]
        assert not bad, f"{name} imports {bad}"


def test_the_runtime_does_not_import_the_search():
    for name, mods in _package_imports("runtime").items():
        bad = [m for m in mods if _within(m, "autodist.sched")]
        assert not bad, f"{name} imports {bad}"


def test_bucketing_and_block_grouping_are_written_once():
    src = {p.name: p.read_text() for p in PKG.rglob("*.py")}
    assert [n for n, s in src.items() if "def bucket_by_size(" in s] == ["builtins.py"]
    assert [n for n, s in src.items() if "def block_groups(" in s] == ["builtins.py"]
    assert [n for n, s in src.items() if "def triggers(" in s] == ["schedule.py"]
