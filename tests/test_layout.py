"""The layering the design promises (docs/design.md, "Module map"): modelling (``cost/``, the
simulator's parts in ``cost/sim/`` included) never imports the runtime, the search, the measuring
code or the planner; the runtime never imports the search or the planner; the research code
(``lab/``) is imported by no library module but the planner's estimator switch, and only when it is
on; plan construction and the schedule's rules (the offload anchors among them) exist once
(``builtins.py``, ``schedule.py``)."""

import ast
import os
import pathlib
import sys

from harness import run_command

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


def _top_level_imports(path: pathlib.Path) -> set[str]:
    """The autodist modules ``path`` imports when it is imported (not inside a function)."""
    here = path.relative_to(PKG.parent).with_suffix("").parts
    out = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ImportFrom):
            base = list(here[: len(here) - node.level]) if node.level else []
            out.add(".".join(base + ([node.module] if node.module else [])) if node.level else node.module or "")
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return {m for m in out if m.startswith("autodist")}


def _within(module: str, *packages: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def _package_imports(sub: str) -> dict[str, set[str]]:
    return {str(p.relative_to(PKG)): _imports(p) for p in (PKG / sub).glob("*.py")}


def test_modelling_imports_neither_the_runtime_nor_the_search_nor_measuring_nor_the_planner():
    for name, mods in _package_imports("cost").items():
        bad = [m for m in mods if _within(m, "autodist.runtime", "autodist.sched", "autodist.measure", "autodist.planner")]
        assert not bad, f"{name} imports {bad}"


def test_the_runtime_imports_neither_the_search_nor_the_planner():
    for name, mods in _package_imports("runtime").items():
        bad = [m for m in mods if _within(m, "autodist.sched", "autodist.planner")]
        assert not bad, f"{name} imports {bad}"


def test_the_lab_is_imported_only_by_the_planners_estimator_switch_when_it_is_on():
    importers = sorted(
        str(p.relative_to(PKG)) for p in PKG.rglob("*.py")
        if p.parent.name != "lab" and any(_within(m, "autodist.lab") for m in _imports(p))
    )
    assert importers == ["planner/estimator.py"]
    # inside the function that reads a stored estimator, never when the planner is imported
    assert not any(_within(m, "autodist.lab") for m in _top_level_imports(PKG / "planner" / "estimator.py"))


def test_plan_auto_without_a_stored_estimator_never_imports_the_lab():
    # a frozen model: plan="auto" profiles, keys and searches it without measuring a comm model
    script = (
        "import sys, tempfile, torch\n"
        "from autodist import AutoDist\n"
        "model = torch.nn.Sequential(torch.nn.Linear(4, 4)).requires_grad_(False)\n"
        "m = AutoDist(model, plan='auto', example_inputs=(torch.ones(2, 4, requires_grad=True),),\n"
        "             cache_dir=tempfile.mkdtemp())\n"
        "m.close()\n"
        "print('searched:', m._auto.stats.source == 'search')\n"
        "print('lab imported:', any(n.startswith('autodist.lab') for n in sys.modules))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(PKG.parent)}
    out = run_command([sys.executable, "-c", script], env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "searched: True" in out.stdout and "lab imported: False" in out.stdout, out.stdout


def test_bucketing_and_block_grouping_are_written_once():
    src = {p.name: p.read_text() for p in PKG.rglob("*.py")}
    assert [n for n, s in src.items() if "def bucket_by_size(" in s] == ["builtins.py"]
    assert [n for n, s in src.items() if "def block_groups(" in s] == ["builtins.py"]
    assert [n for n, s in src.items() if "def triggers(" in s] == ["schedule.py"]


def test_the_simulator_s_parts_import_only_modelling_and_the_schedule():
    parts = _package_imports("cost/sim")
    assert {f"cost/sim/{n}.py" for n in ("program", "emit", "execute")} <= set(parts)
    for name, mods in parts.items():
        bad = [m for m in mods if _within(m, "autodist.runtime", "autodist.sched", "autodist.measure",
                                          "autodist.planner", "autodist.lab", "autodist.lifecycle", "autodist.wrapper")]
        assert not bad, f"{name} imports {bad}"


def test_the_offload_anchors_are_written_once_and_read_by_the_runtime_and_the_simulator():
    src = {str(p.relative_to(PKG)): p.read_text() for p in PKG.rglob("*.py")}
    assert [n for n, s in src.items() if "def offload_anchors(" in s] == ["schedule.py"]
    readers = sorted(n for n, s in src.items() if "offload_anchors(" in s and n != "schedule.py")
    assert readers == ["cost/sim/offload.py", "runtime/offload.py"]
    # nobody else reads the fragments' anchors to decide when to copy
    assert [n for n, s in src.items() if ".out_after, [" in s or ".back_from, [" in s] == ["schedule.py"]
