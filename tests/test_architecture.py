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
    hand the CPU converters to `core.modeling.model.build_model` on the CPU path, so a GPU never loads them)."""
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
    """A worker reads its job and the helpers it shares with its recipe from the engine (`core.launching.jobs`,
    `core.configs.generation`, `core.rl.rl_math`, ...), never from a recipe module: what runs under torchrun builds on
    the engine, the CPU package and the workers' own libraries alone."""
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


PROBES = {
    "torch.cuda.is_available": "whether there is a GPU",
    "torch.cuda.get_device_capability": "the GPU's compute capability",
    "torch.cuda.get_device_name": "the GPU's name",
    "torch.cuda.device_count": "how many GPUs",
    ".has_transformer_engine": "whether Transformer Engine is importable (a fact; the choice made from it is the layers)",
    ".has_flash_attn": "whether flash-attn is importable",
    ".compute_capability": "the GPU's compute capability",
}
"""What reads the hardware, or a fact about it that a build choice is made from."""
PROBE_PLACES = {
    "pai_cookbook/core/machine/",  # the facts (runtime), the one decision made from them (build), CPU compatibility
}
"""Where reading the hardware is the module's job."""


def _probes(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            dotted = ast.unparse(node)
            for probe in PROBES:
                if (dotted == probe if not probe.startswith(".") else dotted.endswith(probe)):
                    found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {dotted}")
        if isinstance(node, ast.Compare) and any(isinstance(c, ast.Constant) and isinstance(c.value, str)
                                                  and c.value.startswith("TE") for c in node.comparators):
            if "__name__" in ast.unparse(node.left):  # a class-name test for Transformer Engine's modules
                found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {ast.unparse(node)}")
    return found


def test_only_the_machine_room_reads_the_hardware():
    """One build plan (`core.machine.build`): the launcher decides what a run builds from the machine's facts and the
    job, once, and every module reads the answer from the `DeviceInfo` it is handed (`layers`, `fused_kernels`,
    `grouped_gemm`, `transformer_engine`). A new probe elsewhere (a `torch.cuda.is_available()` that picks a kernel,
    a test of `has_transformer_engine`, a class-name check) is a second decision that can disagree with the first."""
    found = [hit for path in PACKAGE.rglob("*.py")
             if not any(str(path.relative_to(PACKAGE.parent)).startswith(place) for place in PROBE_PLACES)
             for hit in _probes(path)]
    assert not found, found


def test_the_probe_check_sees_a_probe(tmp_path):
    """The check above finds each kind of probe it names (else it would pass on anything)."""
    planted = tmp_path / "planted.py"
    planted.write_text("import torch\n"
                       "a = torch.cuda.is_available()\n"
                       "b = device.has_transformer_engine\n"
                       "c = any(type(m).__name__ == 'TEDotProductAttention' for m in [])\n")
    global PACKAGE
    saved, PACKAGE = PACKAGE, tmp_path
    try:
        assert len(_probes(planted)) == 3
    finally:
        PACKAGE = saved


ROOMS = ("machine", "launching", "configs", "modeling", "checkpoints", "text", "measures", "rl")


def test_the_engine_is_in_rooms():
    """core/ holds rooms, one per purpose (core/__init__.py names them), and no module of its own: a new module goes
    into the room of what it does."""
    core = PACKAGE / "core"
    loose = sorted(p.name for p in core.glob("*.py") if p.name != "__init__.py")
    assert not loose, loose
    rooms = sorted(p.name for p in core.iterdir() if (p / "__init__.py").exists())
    assert rooms == sorted(ROOMS), rooms
    said = (core / "__init__.py").read_text(encoding="utf-8")
    assert all(f"`{room}`" in said for room in ROOMS)


def test_recipes_never_import_the_notebook_helpers_or_fixtures():
    """The recipes (and everything under torchrun) run without the notebooks' figures or the fixtures' downloads:
    `pai_cookbook.notebook` and `pai_cookbook.fixtures` build on the recipes, never the other way round."""
    helpers = ("pai_cookbook.notebook", "pai_cookbook.fixtures")
    wrong = [(s, t) for s, targets in imports().items() if not s.startswith(helpers)
             for t, _ in targets if t.startswith(helpers)]
    assert not wrong, wrong
