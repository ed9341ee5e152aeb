"""The import rules docs/architecture.md states, checked on the package's own imports (module level and inside
functions alike, `TYPE_CHECKING` blocks too): a rule broken here is a house that no longer matches its plan."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "pai_cookbook"


def _module(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _part(module: str) -> str:
    """engine (core), cpu, workers, or recipes (the package's top-level modules)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in ("core", "cpu", "workers") else "recipes"


def imports() -> dict[str, set[tuple[str, bool]]]:
    """module -> {(imported pai_cookbook module, imported inside a function)}; `from pkg import name` resolves to
    pkg.name when that is a module of the package."""
    modules = {_module(p) for p in PACKAGE.rglob("*.py")}
    found: dict[str, set[tuple[str, bool]]] = defaultdict(set)
    for path in PACKAGE.rglob("*.py"):
        source = _module(path)
        tree = ast.parse(path.read_text(encoding="utf-8"))
        in_function = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                       for n in ast.walk(f) if n is not f}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                           for a in node.names]
            else:
                continue
            for target in targets:
                if target.startswith("pai_cookbook") and target != source:
                    found[source].add((target, id(node) in in_function))
    return found


def test_the_import_graph_has_no_cycles():
    graph = {source: {target for target, _ in targets} for source, targets in imports().items()}
    state: dict[str, int] = {}
    cycles = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append(path[path.index(nxt):] + [nxt] if nxt in path else [node, nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert not cycles, cycles


def test_the_engine_imports_only_itself():
    """core/ is the engine every step shares: it never imports a recipe, a worker or the CPU speed work (the workers
    hand the CPU converters to `core.model.build_model` on the CPU path, so a GPU never loads them)."""
    wrong = [(source, target) for source, targets in imports().items() if _part(source) == "core"
             for target, _ in targets if _part(target) != "core"]
    assert not wrong, wrong


def test_the_cpu_package_builds_on_the_engine_alone():
    wrong = [(s, t) for s, targets in imports().items() if _part(s) == "cpu"
             for t, _ in targets if _part(t) not in ("core", "cpu")]
    assert not wrong, wrong


def _has_entry(path: Path) -> bool:
    """Whether a module defines a function decorated `@worker.entry(...)` (what torchrun runs)."""
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.FunctionDef):
            for decorator in node.decorator_list:
                call = decorator.func if isinstance(decorator, ast.Call) else decorator
                if isinstance(call, ast.Attribute) and call.attr == "entry":
                    return True
    return False


def test_no_module_imports_a_worker_module():
    """A worker module (one with a `@worker.entry` main) is what torchrun runs: nothing imports it, not even another
    worker. What the workers share is a library beside them (`workers.training`, `workers.run_state`)."""
    entries = {_module(p) for p in PACKAGE.rglob("*.py") if _has_entry(p)}
    assert "pai_cookbook.workers.train" in entries
    wrong = [(s, t) for s, targets in imports().items() for t, _ in targets if t in entries]
    assert not wrong, wrong


def test_the_workers_import_no_recipe():
    """A worker reads its job and the helpers it shares with its recipe from the engine (`core.jobs`, `core.generation`,
    `core.rl_math`, ...), never from a recipe module: what runs under torchrun builds on the engine, the CPU package and
    the workers' own libraries alone."""
    wrong = [(s, t) for s, targets in imports().items() if _part(s) == "workers"
             for t, _ in targets if _part(t) == "recipes"]
    assert not wrong, wrong


def test_only_the_launcher_runs_a_worker():
    """No recipe (or engine module) imports a worker: the launcher starts it under torchrun, or in this process
    (`launch.run_here`, which imports the job's worker module by its name), so what runs where stays visible."""
    wrong = [(s, t) for s, targets in imports().items() if _part(s) != "workers"
             for t, _ in targets if _part(t) == "workers"]
    assert not wrong, wrong


def test_every_module_is_read_in_one_sitting():
    """The house's own aim: every module under 400 lines; one that grows past it is split along what it does."""
    long = {str(path.relative_to(PACKAGE.parent)): n for path in PACKAGE.rglob("*.py")
            if (n := len(path.read_text(encoding="utf-8").splitlines())) >= 400}
    assert not long, long
