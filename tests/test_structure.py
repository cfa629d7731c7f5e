"""The shape of the code base: no import cycles, no pipeline reaching into another pipeline's nodes,
a Kedro-free core, files a reader can hold (<= 400 lines), and the suite's own scheduling."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
PKG = SRC / "qerl"
KEDRO_LAYER = ("qerl.pipelines", "qerl.datasets", "qerl.hooks", "qerl.settings", "qerl.cli", "qerl.runner",
               "qerl.config_loader", "qerl.tracking", "qerl.pipeline_registry", "qerl.__main__")
MAX_LINES = 400


def _module_name(path: Path) -> str:
    rel = path.relative_to(SRC).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


MODULES = {_module_name(p): p for p in PKG.rglob("*.py")}


def _resolve(name: str) -> str | None:
    """The qerl module an import of ``name`` executes (a submodule if there is one, else its package)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _type_checking_lines(tree: ast.Module) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for sub in ast.walk(node):
                if hasattr(sub, "lineno"):
                    lines.add(sub.lineno)
    return lines


def imports_of(module: str) -> set[str]:
    """Every module this one imports, anywhere in it (function bodies too), except TYPE_CHECKING blocks."""
    path = MODULES[module]
    tree = ast.parse(path.read_text())
    skip = _type_checking_lines(tree)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in skip:
            continue
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            subs = [f"{base}.{a.name}" for a in node.names]
            names = [n for n in subs if n in MODULES] or [base]  # `from pkg import mod` imports mod
        for n in names:
            if n.startswith("qerl"):
                target = _resolve(n)
                if target and target != module:
                    found.add(target)
    return found


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


GRAPH = {m: imports_of(m) for m in MODULES}


def test_no_import_cycles() -> None:
    assert _cycles(GRAPH) == []


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_pipeline_imports_another_pipelines_nodes() -> None:
    bad = []
    for m, deps in GRAPH.items():
        if m.startswith("qerl.pipelines."):
            mine = m.split(".")[2]
            bad += [(m, d) for d in deps if d.startswith("qerl.pipelines.") and d.endswith(".nodes")
                    and d.split(".")[2] != mine]
    assert bad == []


def test_the_core_does_not_import_kedro() -> None:
    offenders = []
    for m, path in MODULES.items():
        if m.startswith(KEDRO_LAYER):
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            mods = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            offenders += [(m, x) for x in mods if x.split(".")[0] in ("kedro", "kedro_datasets")]
    assert offenders == []


@pytest.mark.parametrize("path", sorted(PKG.rglob("*.py")), ids=lambda p: str(p.relative_to(PKG)))
def test_files_stay_readable(path: Path) -> None:
    assert len(path.read_text().splitlines()) <= MAX_LINES


@pytest.mark.parametrize("extra,expected", [([], "loadfile"), (["--dist", "load"], "load")])
def test_xdist_keeps_each_test_file_on_one_worker(tmp_path: Path, extra: list[str], expected: str) -> None:
    """``pytest -n N`` alone schedules by file (tests/conftest.py: tests/test_cli.py is one
    scenario in order); a ``--dist`` given on the command line is kept."""
    pytest.importorskip("xdist")
    (tmp_path / "dist_probe.py").write_text(
        "import os\n"
        "def pytest_sessionstart(session):\n"
        "    if not hasattr(session.config, 'workerinput'):\n"
        "        open(os.environ['DIST_PROBE_OUT'], 'w').write(session.config.option.dist)\n")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "DIST_PROBE_OUT": str(tmp_path / "dist.txt")}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "dist_probe", "-p", "no:cacheprovider", "-n", "2",
                           *extra, f"{Path(__file__).resolve()}::test_no_import_cycles"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert (tmp_path / "dist.txt").read_text() == expected
