"""The layers the README draws, checked on the import graph of ``src/moetrain``.

Every ``moetrain`` import is read with ``ast``, at module level and inside functions alike (an import in
a function is still a dependency; it only runs later). The packages sit in layers, lowest first: the
errors and small shared modules, the torch-free configs, cost formulas, planner and balancing policy,
then the runtime (models and data, the runtime base, memory, the distributed layer, the training loop),
Hugging Face interop, RL, and the command line on top. A package imports only from layers below its own
(or from itself); siblings in one layer do not import each other. On top of that: no import cycle between
packages, nor between the modules of one package, no private name (``_x``) imported from another
package, torch never below the runtime and argparse never outside ``cli/``.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import NamedTuple

SRC = Path(__file__).resolve().parents[1] / "src" / "moetrain"

# Lowest first. A top-level module (``moetrain/errors.py``) counts as a package of its own.
LAYERS: list[tuple[str, ...]] = [
    ("errors",),
    ("textfile", "threads", "status", "schedules"),  # small shared helpers, torch-free
    ("config",),  # pydantic configs and presets: no torch
    ("costs",),  # parameter / FLOP / activation formulas: no torch
    ("planner",),  # simulator and search: no torch
    ("balance",),  # load prediction, placement, migration policy (prices with the planner's formulas)
    ("models", "data"),  # the runtime starts here: torch modules; corpus and tokenizer
    ("runtime_base",),  # what the runtime's parts share: precision, optimizer, host memory, ckpt files
    ("memory",),  # recompute/swap policy and activation measurement on the models
    ("distributed",),  # parallel layout, the step, collectives, DCP checkpoints, launcher
    ("train",),  # the one training loop and the rank that runs it
    ("hf",),  # Hugging Face checkpoints in and out
    ("rl",),  # RL post-training on the same runtime
    ("cli",),  # the command line: one module per subcommand, and the torchrun entry point
    ("__main__",),
]
LAYER_OF = {package: i for i, layer in enumerate(LAYERS) for package in layer}
RUNTIME_FLOOR = LAYER_OF["models"]  # torch may be imported from this layer up

# (importing module, imported module): one line why. Keep this short; fix the code instead.
ALLOWED: dict[tuple[str, str], str] = {}

# Module cycles inside a package that are being removed now: each entry goes when its cycle does.
KNOWN_MODULE_CYCLES: dict[tuple[str, ...], str] = {}


# Files whose imports inside functions do not say why yet, being edited by other work now: each entry goes
# when its file's imports carry their comment.
UNEXPLAINED_LAZY_IMPORTS: dict[str, str] = {}


class Edge(NamedTuple):
    source: str  # importing module, dotted
    line: int
    target: str  # imported module (or module.name for ``from m import name``), dotted
    in_function: bool

    def __str__(self) -> str:
        where = "inside a function" if self.in_function else "at module level"
        return f"{self.source}:{self.line} imports {self.target} ({where})"


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_of(module: str) -> str:
    """``moetrain.distributed.step`` -> ``distributed``; ``moetrain.errors`` -> ``errors``; ``moetrain`` -> ``""``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "moetrain" else ""


def imports_of(path: Path, source: str | None = None) -> list[Edge]:
    """Every import in ``path`` (module ``source``, by default its name under ``src``): ``import a.b`` gives
    ``a.b``; ``from a import b`` gives ``a`` and ``a.b``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    in_function = {id(node) for fn in ast.walk(tree) if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef)
                   for node in ast.walk(fn)}
    source = source or module_name(path)
    edges = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            package = source.split(".")[: len(source.split(".")) - node.level + (path.name == "__init__.py")]
            base = ".".join(package + [node.module] if node.level and node.module else package) if node.level else (
                node.module or "")  # a relative import (the exported Hugging Face code) stays in its folder
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        edges += [Edge(source, node.lineno, target, id(node) in in_function) for target in targets]
    return edges


def all_edges() -> list[Edge]:
    return [edge for path in sorted(SRC.rglob("*.py")) for edge in imports_of(path)]


def cross_package(edges: list[Edge]) -> list[Edge]:
    return [e for e in edges if e.target.startswith("moetrain.") and package_of(e.target)
            and package_of(e.target) != package_of(e.source) and package_of(e.source)]


def allowed(edge: Edge) -> bool:
    return any(edge.source == src and (edge.target == dst or edge.target.startswith(dst + "."))
               for src, dst in ALLOWED)


def upward(edges: list[Edge]) -> list[Edge]:
    """Imports from a package into one of the same or a higher layer (that is not itself)."""
    return [e for e in cross_package(edges) if not allowed(e)
            and LAYER_OF[package_of(e.target)] >= LAYER_OF[package_of(e.source)]]


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan), each sorted: the import cycles."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def package_cycles(edges: list[Edge]) -> list[list[str]]:
    """The import cycles between packages."""
    graph: dict[str, set[str]] = {}
    for e in cross_package(edges):
        if not allowed(e):
            graph.setdefault(package_of(e.source), set()).add(package_of(e.target))
    return strongly_connected(graph)


def module_cycles(edges: list[Edge], modules: set[str]) -> list[list[str]]:
    """The import cycles between the modules of one package (``modules``: every module name). ``from a
    import b`` depends on module ``a.b`` when there is one, else on ``a``: the package's ``__init__`` that
    every submodule import runs first is not itself a dependency."""
    def module_of(target: str) -> str:
        while target and target not in modules:
            target = target.rpartition(".")[0]
        return target

    by_statement: dict[tuple[str, int], list[str]] = {}
    for e in edges:
        if package_of(e.source) and package_of(e.target) == package_of(e.source):
            by_statement.setdefault((e.source, e.line), []).append(e.target)
    graph: dict[str, set[str]] = {}
    for (source, _), targets in by_statement.items():
        for target in targets:
            if any(other.startswith(target + ".") for other in targets):
                continue  # the ``a`` of ``from a import b``: its names stand for it
            if (module := module_of(target)) and module != source:
                graph.setdefault(source, set()).add(module)
    return strongly_connected(graph)


def _describe(edges: list[Edge]) -> str:
    """One line per import statement: ``from a import b, c`` is shown once, as ``a.b, a.c``."""
    lines: dict[tuple[str, int], list[Edge]] = {}
    for e in edges:
        lines.setdefault((e.source, e.line), []).append(e)
    shown = []
    for group in lines.values():
        named = [e for e in group if not any(other.target.startswith(e.target + ".") for other in group)]
        shown.append(f"  {named[0]}" + "".join(f", {e.target.rsplit('.', 1)[-1]}" for e in named[1:]))
    return "\n".join(shown)


def test_every_package_has_a_layer():
    packages = {package_of(module_name(p)) for p in SRC.rglob("*.py")} - {""}
    assert sorted(packages - set(LAYER_OF)) == [], "place each new package in LAYERS"


def test_no_import_cycle_between_packages():
    edges = all_edges()
    cycles = package_cycles(edges)
    # Every cycle holds an import against the layer order: those are the ones to show.
    detail = "\n".join(" <-> ".join(cycle) + "\n" + _describe([e for e in upward(edges) if package_of(e.source) in cycle
                                                             and package_of(e.target) in cycle]) for cycle in cycles)
    assert cycles == [], f"import cycles between packages:\n{detail}"


def all_modules() -> set[str]:
    return {module_name(path) for path in SRC.rglob("*.py")}


def test_no_import_cycle_between_modules_of_a_package():
    cycles = [cycle for cycle in module_cycles(all_edges(), all_modules()) if tuple(cycle) not in KNOWN_MODULE_CYCLES]
    assert cycles == [], "import cycles between modules (function-level imports count); move what both need " \
        "into a module below them:\n" + "\n".join(" <-> ".join(cycle) for cycle in cycles)


def test_every_known_module_cycle_is_still_there():
    cycles = {tuple(cycle) for cycle in module_cycles(all_edges(), all_modules())}
    gone = [cycle for cycle in KNOWN_MODULE_CYCLES if cycle not in cycles]
    assert gone == [], f"cycles that are gone (or changed); drop them from KNOWN_MODULE_CYCLES: {gone}"


def test_no_upward_import_between_layers():
    found = upward(all_edges())
    assert found == [], "imports into the same or a higher layer (see LAYERS):\n" + _describe(found)


def test_no_private_name_across_packages():
    found = [e for e in cross_package(all_edges())
             if any(part.startswith("_") and not part.startswith("__") for part in e.target.split("."))]
    assert found == [], "private names imported from another package; make them public or move them:\n" + (
        _describe(found))


def test_torch_stays_in_the_runtime_and_argparse_in_the_cli():
    edges = all_edges()
    torch_low = [e for e in edges if (e.target == "torch" or e.target.startswith("torch."))
                 and LAYER_OF.get(package_of(e.source), 0) < RUNTIME_FLOOR]
    argparse_out = [e for e in edges if e.target == "argparse" and package_of(e.source) != "cli"]
    assert torch_low + argparse_out == [], "torch below the runtime or argparse outside cli/:\n" + _describe(
        torch_low + argparse_out)


def test_every_allowed_exception_is_still_needed():
    edges = cross_package(all_edges())
    stale = [pair for pair in ALLOWED if not any(e.source == pair[0] and (e.target == pair[1] or e.target.startswith(
        pair[1] + ".")) for e in edges)]
    assert stale == [], f"exceptions no import needs any more; drop them from ALLOWED: {stale}"


def test_the_checks_catch_a_planted_upward_import_and_cycle(tmp_path: Path):
    planted = tmp_path / "moetrain"
    (planted / "config").mkdir(parents=True)
    (planted / "train").mkdir()
    (planted / "config" / "__init__.py").write_text("def f():\n    from moetrain.train.loop import run\n")
    (planted / "train" / "__init__.py").write_text("from moetrain.config import f\nfrom moetrain.config import _g\n")
    edges = []
    for path in sorted(planted.rglob("*.py")):
        module = ".".join(path.relative_to(tmp_path).with_suffix("").parts[:-1])
        edges += imports_of(path, source=module)
    assert [str(e) for e in upward(edges)] == [
        "moetrain.config:2 imports moetrain.train.loop (inside a function)",
        "moetrain.config:2 imports moetrain.train.loop.run (inside a function)"]
    assert package_cycles(edges) == [["config", "train"]]


def test_the_module_check_catches_a_planted_cycle_through_a_function(tmp_path: Path):
    planted = tmp_path / "moetrain" / "rl"
    planted.mkdir(parents=True)
    files = {"__init__": "from moetrain.rl.a import f\n",
             "a": "from moetrain.rl import b\n\ndef f():\n    return b\n",
             "b": "def g():\n    from moetrain.rl.c import h\n    return h\n",
             "c": "from moetrain.rl.a import f\nfrom moetrain.rl import d\n",
             "d": "from moetrain.rl import f\n"}  # a name of the package's __init__

    def cycles() -> list[list[str]]:
        for name, text in files.items():
            (planted / f"{name}.py").write_text(text)
        modules = {"moetrain.rl" if name == "__init__" else f"moetrain.rl.{name}" for name in files}
        edges = [e for name in files for e in imports_of(
            planted / f"{name}.py", source="moetrain.rl" if name == "__init__" else f"moetrain.rl.{name}")]
        return module_cycles(edges, modules)

    assert cycles() == [["moetrain.rl", "moetrain.rl.a", "moetrain.rl.b", "moetrain.rl.c", "moetrain.rl.d"]]
    files["d"] = ""
    assert cycles() == [["moetrain.rl.a", "moetrain.rl.b", "moetrain.rl.c"]]  # closed by the import in g()
    files["b"] = ""
    assert cycles() == []


def unexplained_lazy_imports(path: Path) -> list[int]:
    """Lines of the imports inside functions of ``path`` that no comment explains: one on the import's own
    lines, or one just above the block of imports it opens (blank lines inside the block allowed)."""
    text = path.read_text()
    lines = text.splitlines()
    nodes = [node for fn in ast.walk(ast.parse(text)) if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef)
             for node in ast.walk(fn) if isinstance(node, ast.Import | ast.ImportFrom)]
    import_lines = {i for node in nodes for i in range(node.lineno - 1, node.end_lineno)}
    found = set()
    for node in nodes:
        if any("#" in lines[i] for i in range(node.lineno - 1, node.end_lineno)):
            continue
        above = node.lineno - 2
        while above >= 0 and (above in import_lines or (not lines[above].strip() and above - 1 in import_lines)):
            above -= 1
        if above < 0 or not lines[above].strip().startswith("#"):
            found.add(node.lineno)
    return sorted(found)


def test_every_import_inside_a_function_says_why():
    found = [f"  {path.relative_to(SRC)}:{line}" for path in sorted(SRC.rglob("*.py"))
             if path.relative_to(SRC).as_posix() not in UNEXPLAINED_LAZY_IMPORTS
             for line in unexplained_lazy_imports(path)]
    assert found == [], ("imports inside functions without a comment saying why (an optional dependency, a heavy "
                         "import kept off a light path, a cycle); move them to module level otherwise:\n"
                         + "\n".join(found))


def test_every_file_with_unexplained_imports_still_has_some():
    done = [name for name in UNEXPLAINED_LAZY_IMPORTS if not unexplained_lazy_imports(SRC / name)]
    assert done == [], f"these files explain every import now; drop them from UNEXPLAINED_LAZY_IMPORTS: {done}"


def test_the_lazy_import_check_reads_comments_on_the_line_and_above_the_block(tmp_path: Path):
    module = tmp_path / "m.py"
    module.write_text("def f():\n    # heavy\n    import a\n\n    import b\n    x = 1\n    import c\n"
                      "    import d  # optional\n    import e\n")
    assert unexplained_lazy_imports(module) == [7, 9]
