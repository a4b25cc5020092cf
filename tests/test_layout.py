"""The house rules of launcher/ (docs/architecture.md): one folder per stage, each importing only the folders below
it, no import circle, and the heavy libraries out of the light commands' modules. Read from the code's own imports,
function-level imports included, so that a new arrow the wrong way fails here."""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import REPO

PACKAGE = REPO / "launcher"
# Each folder and the folders it may import (root leaves are always allowed), top to bottom.
MAY_IMPORT = {
    "run": {"deliver", "worker", "plan", "data", "store"},
    "deliver": {"worker", "plan", "data", "store"},
    "worker": {"plan", "data", "store"},
    "plan": {"data"},
    "data": {"store"},
    "store": set(),
}
# Root leaves and the folders each may import: the recipe validates against tables that live in their stages.
ROOT_MAY_IMPORT = {
    "cli": set(MAY_IMPORT),
    "recipe": {"data"},
    "recipe_sections": {"data", "store"},
    "recipe_loading": {"data", "store"},
}


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(REPO).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    found = set()
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text())):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                here = name.split(".") if is_package else name.split(".")[:-1]
                base = ".".join(here[: len(here) - node.level + 1] + ([node.module] if node.module else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        for t in targets:
            while t and t not in modules and "." in t:
                t = t.rsplit(".", 1)[0]
            if t in modules and t != name:
                found.add(t)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _folder(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "launcher"


def _is_folder(module: str) -> bool:
    return (PACKAGE / _folder(module)).is_dir()


def test_every_folder_imports_only_the_folders_below_it():
    wrong = []
    for module, targets in _graph().items():
        here = _folder(module)
        for target in targets:
            there = _folder(target)
            if there == here or not _is_folder(target):
                continue  # within a folder, or a root leaf
            allowed = MAY_IMPORT.get(here) if _is_folder(module) else ROOT_MAY_IMPORT.get(here, set())
            if there not in allowed:
                wrong.append(f"{module} -> {target}")
    assert not wrong, "imports against docs/architecture.md's table:\n" + "\n".join(sorted(wrong))


def test_no_folder_imports_a_root_leaf_that_imports_it():
    """The recipe imports the tables it validates against (data/, store/): those folders never import the recipe."""
    graph = _graph()
    back = []
    for leaf, targets in graph.items():
        if _is_folder(leaf):
            continue
        for folder in {_folder(t) for t in targets if _is_folder(t)}:
            back += [
                f"{leaf} -> {folder}/ -> {m} -> {leaf}"
                for m, ts in graph.items()
                if _is_folder(m) and _folder(m) == folder and leaf in ts
            ]
    assert not back, back


def test_no_import_circle():
    graph = _graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                circles.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    assert not circles, circles


def test_every_module_says_what_it_is_for():
    missing = [name for name, path in _modules().items() if not ast.get_docstring(ast.parse(path.read_text()))]
    assert not missing, missing


def test_the_tests_mirror_the_folders():
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").is_file()}
    tests = {p.name for p in (REPO / "tests").iterdir() if p.is_dir() and not p.name.startswith((".", "_"))}
    assert folders <= tests, f"launcher folders without a tests folder: {sorted(folders - tests)}"


def test_a_command_reads_its_run_once():
    """state.json is read by store/state.py, whose RunSnapshot each command takes at its start and passes down; the
    supervisor and the steps after training (launcher/run/supervisor.py, after_training.py) read it where they wait on
    a change. Any other module asks the snapshot it is given."""
    readers = {
        str(p.relative_to(PACKAGE))
        for p in PACKAGE.rglob("*.py")
        if "read_state(" in p.read_text().replace("def read_state(", "")
    }
    assert readers <= {"store/state.py", "run/supervisor.py", "run/after_training.py"}, readers


def test_state_is_written_by_one_module_through_its_table():
    """store/state.py's set_state is the one writer of state.json; the product calls it through `move`, naming a row of
    MOVES (who makes which write), and every row is made somewhere: a reader finds every write in the table."""
    import re

    from launcher.store.state import MOVES

    # (?<!\.): numpy.random.set_state, which the reward probe calls to restore the generators, is not this one
    calls = re.compile(r"(?<![.\w])set_state\(")
    writers = {str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py") if calls.search(p.read_text())}
    assert writers == {"store/state.py"}, writers
    made = {
        name
        for p in PACKAGE.rglob("*.py")
        for name in re.findall(r"(?:\bmove|\b_record)\(\s*run,\s*\"([a-z-]+)\"", p.read_text())
    }
    assert made == set(MOVES), f"moves made but not in MOVES: {made - set(MOVES)}; rows never made: {set(MOVES) - made}"
