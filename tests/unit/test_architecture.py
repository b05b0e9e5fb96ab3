"""Layering checks over the whole `polar_mitm` package.

- The store is the bottom layer: importing it (every module of it) and opening a Store imports no assembler
  module. The assembler imports the store, never the other way round.
- No import cycle among `polar_mitm` modules. The graph is built from each module's module-level imports
  (read with `ast`, nothing is executed): an import inside a function runs only when the function is called,
  so it is allowed and not counted (it is how the CLI loads its commands lazily), unless the module itself calls
  that function while it is imported (then the import runs at import time and counts); an import under
  `if TYPE_CHECKING:` never runs and is not counted either. `import a.b` / `from a.b import c` is an edge to
  `a.b` (or to the submodule `a.b.c` when `c` is one); the parent packages that Python initialises on the way
  are not edges, since a package importing its own submodules is how packages are built.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import polar_mitm

PACKAGE = Path(polar_mitm.__file__).parent


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _module_level_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Imports that run when the module is imported: at top level, in top-level if/try/with blocks and class
    bodies, and inside the module's own functions that those statements call (e.g. a constant built by a call)."""
    functions = {node.name: node for node in tree.body if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}
    found: list[ast.Import | ast.ImportFrom] = []
    called: list[str] = []
    pending: list[ast.stmt] = list(tree.body)
    while pending:
        node = pending.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        elif isinstance(node, ast.If):
            if not _is_type_checking(node.test):
                pending += node.body
            pending += node.orelse
        elif isinstance(node, ast.Try):
            pending += node.body + node.orelse + node.finalbody + [stmt for handler in node.handlers for stmt in handler.body]
        elif isinstance(node, (ast.With, ast.ClassDef)):
            pending += node.body
        elif not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            called += [call.func.id for call in ast.walk(node) if isinstance(call, ast.Call) and isinstance(call.func, ast.Name)]
    seen: set[str] = set()
    while called:
        name = called.pop()
        if name in functions and name not in seen:
            seen.add(name)
            for node in ast.walk(functions[name]):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    found.append(node)
                elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                    called.append(node.func.id)
    return found


def import_graph() -> dict[str, set[str]]:
    """module -> the polar_mitm modules it imports at module level."""
    modules = _modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        for node in _module_level_imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                if node.level:
                    base = name.split(".")
                    base = base[: len(base) - node.level + (1 if is_package else 0)]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                targets = [f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules else source for alias in node.names]
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]  # `import a.b.c` of a non-module name: its module
                if target.startswith("polar_mitm") and target != name:
                    graph[name].add(target)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle (first module repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == 1:
                return path[path.index(target):] + [target]
            if target not in state:
                cycle = visit(target)
                if cycle:
                    return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_which_imports_count_as_module_level():
    source = """
import polar_mitm.a
from typing import TYPE_CHECKING
if TYPE_CHECKING:
    import polar_mitm.typing_only
def lazy():
    import polar_mitm.lazy
def at_import():
    from polar_mitm import called
CONSTANT = f"{at_import()}"
class C:
    from polar_mitm import in_class
"""
    names = {alias.name if isinstance(node, ast.Import) else f"{node.module}.{alias.name}" for node in _module_level_imports(ast.parse(source)) for alias in node.names}
    assert names == {"polar_mitm.a", "typing.TYPE_CHECKING", "polar_mitm.called", "polar_mitm.in_class"}


def test_the_graph_sees_module_level_imports_only():
    graph = import_graph()
    # the store's own modules are found, and the assembler imports the store (an edge the checks below rely on)
    assert "polar_mitm.store" in graph
    assert any(target.startswith("polar_mitm.store") for target in graph["polar_mitm.assembler.source"])


def test_no_import_cycle_among_polar_mitm_modules():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle at module level: " + " -> ".join(cycle or [])


def _all_imports(path: Path) -> set[str]:
    """Every absolute `polar_mitm...` module named by an import anywhere in the file, lazy ones included."""
    named: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            named |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            named |= {f"{node.module}.{alias.name}" for alias in node.names} | {node.module}
    return {name for name in named if name.startswith("polar_mitm")}


def test_the_store_imports_nothing_above_it_even_lazily():
    """The store is the bottom layer (with errors.py): none of its modules imports any other polar_mitm module,
    not even inside a function, since opening a Store runs those imports."""
    below = ("polar_mitm.store", "polar_mitm.errors")
    offending = {
        _module_name(path): sorted(name for name in _all_imports(path) if name != "polar_mitm" and not any(name == b or name.startswith(b + ".") for b in below))
        for name, path in _modules().items()
        if name == "polar_mitm.store" or name.startswith("polar_mitm.store.")
    }
    assert offending and not {name: found for name, found in offending.items() if found}, offending


STORE_IMPORTS = """
import importlib, json, pkgutil, sys, tempfile
from pathlib import Path
import polar_mitm.store as store
names = [store.__name__]
if hasattr(store, "__path__"):
    names += [info.name for info in pkgutil.walk_packages(store.__path__, store.__name__ + ".")]
for name in names:
    importlib.import_module(name)
with tempfile.TemporaryDirectory() as tmp:
    opened = store.Store(Path(tmp) / "s.duckdb")
    opened.query("SELECT * FROM session_timeline")
    opened.close()
print(json.dumps(sorted(m for m in sys.modules if m.startswith("polar_mitm.") and not m.startswith("polar_mitm.store"))))
"""


def test_the_store_imports_no_assembler_module():
    done = subprocess.run([sys.executable, "-c", STORE_IMPORTS], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    imported = json.loads(done.stdout.strip().splitlines()[-1])
    assert not [m for m in imported if m.startswith("polar_mitm.assembler")], f"the store imported {imported}"


# -- module length: no module over LONGEST lines unless its docstring says why

LONGEST = 500
LENGTH_MARKER = "Length:"  # a docstring line starting with it gives the reason a module is longer (one cohesive unit)


def long_modules_without_a_reason(modules: dict[str, Path], longest: int = LONGEST) -> dict[str, int]:
    """Modules over `longest` lines whose docstring has no line starting with LENGTH_MARKER: name -> lines."""
    found = {}
    for name, path in modules.items():
        text = path.read_text()
        lines = text.count("\n") + (not text.endswith("\n"))
        docstring = ast.get_docstring(ast.parse(text, str(path))) or ""
        if lines > longest and not any(line.strip().startswith(LENGTH_MARKER) for line in docstring.splitlines()):
            found[name] = lines
    return found


def test_the_length_check_counts_lines_and_reads_the_marker(tmp_path: Path) -> None:
    short, long, explained = tmp_path / "short.py", tmp_path / "long.py", tmp_path / "explained.py"
    short.write_text('"""Short."""\n' + "x = 1\n" * 3)
    long.write_text('"""Long."""\n' + "x = 1\n" * 10)
    explained.write_text(f'"""Long.\n\n{LENGTH_MARKER} one grammar, read top to bottom.\n"""\n' + "x = 1\n" * 10)
    assert long_modules_without_a_reason({"short": short, "long": long, "explained": explained}, longest=5) == {"long": 11}


def test_no_module_is_over_500_lines_without_a_reason_in_its_docstring() -> None:
    offending = long_modules_without_a_reason(_modules())
    assert not offending, f"over {LONGEST} lines, and no '{LENGTH_MARKER} ...' line in the docstring says why: {offending}"


# -- Ray: imported only inside polar_mitm/rollout/ray/, and there only lazily

RAY_PACKAGE = "polar_mitm.rollout.ray"


def _ray_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    return [
        node for node in ast.walk(tree)
        if (isinstance(node, ast.Import) and any(a.name == "ray" or a.name.startswith("ray.") for a in node.names))
        or (isinstance(node, ast.ImportFrom) and not node.level and node.module and (node.module == "ray" or node.module.startswith("ray.")))
    ]


def test_ray_is_imported_only_inside_the_ray_package_and_only_lazily() -> None:
    outside, at_import = [], []
    for name, path in _modules().items():
        tree = ast.parse(path.read_text(), str(path))
        inside = name == RAY_PACKAGE or name.startswith(RAY_PACKAGE + ".")
        if not inside and _ray_imports(tree):
            outside.append(name)
        if inside and any(node in _module_level_imports(tree) for node in _ray_imports(tree)):
            at_import.append(name)
    assert not outside, f"modules outside {RAY_PACKAGE} import ray: {outside}"
    assert not at_import, f"modules of {RAY_PACKAGE} import ray when they are imported (import it inside the function that needs it): {at_import}"


SERVER_IMPORTS = """
import json, sys, tempfile
from pathlib import Path
import polar_mitm.rollout.server
import polar_mitm.rollout.ray_cluster  # where trainers import RolloutCluster from: Ray comes with a cluster's start
from polar_mitm.cli import build_parser
from polar_mitm.cli import rollout as rollout_cli
with tempfile.TemporaryDirectory() as tmp:
    args = build_parser().parse_args(["rollout", "serve", "--upstream", "http://127.0.0.1:9/v1", "--db", str(Path(tmp) / "s.duckdb")])
    server = rollout_cli._uvicorn_server(args, 0)  # what `polar-mitm rollout serve` builds before it serves
    assert type(server.config.app.state.backend).__name__ == "LocalBackend"
print(json.dumps(sorted(m for m in sys.modules if m == "ray" or m.startswith("ray."))))
"""


def test_the_rollout_server_without_ray_imports_no_ray_module() -> None:
    done = subprocess.run([sys.executable, "-c", SERVER_IMPORTS], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []


# -- README's "Where things live": its rows are layers, top first; the table names every module

README = PACKAGE.parent / "README.md"


def readme_layers() -> list[tuple[str, set[str]]]:
    """(layer name, module paths relative to the repository) per row of README's "Where things live" table.

    In a row, `polar_mitm/x/` sets the folder the following bare file names (`a.py`, `sub/b.py`) are in;
    `polar_mitm/x/*.py` names every module of that folder; `polar_mitm/x.py` names one module."""
    section = README.read_text().split("## Where things live", 1)[1].split("\n## ", 1)[0]
    layers = []
    for line in section.splitlines():
        if not line.startswith("| ") or line.startswith(("| layer", "|---")):
            continue
        name, cell = line.strip("|").split("|", 1)
        folder, named = "", set()
        for token in re.findall(r"`([^`]+)`", cell):
            if token.startswith("polar_mitm/"):
                if token.endswith("/"):
                    folder = token
                elif token.endswith("/*.py"):
                    folder = token[: -len("*.py")]
                    named |= {str(p.relative_to(PACKAGE.parent)) for p in (PACKAGE.parent / folder).glob("*.py") if p.name not in ("__init__.py", "__main__.py")}
                else:
                    named.add(token)
                    folder = token.rsplit("/", 1)[0] + "/"
            elif token.endswith(".py") and folder and not token.endswith("__init__.py"):
                named.add(folder + token)
        layers.append((name.strip(), named))
    return layers


def test_readme_names_every_module_once_and_only_modules_that_exist():
    layers = readme_layers()
    assert len(layers) >= 10, "README's 'Where things live' table was not found"
    rows: dict[str, list[str]] = {}
    for name, named in layers:
        for path in named:
            rows.setdefault(path, []).append(name)
    missing = [path for path in rows if not (PACKAGE.parent / path).exists()]
    assert not missing, f"README names modules that do not exist: {missing}"
    modules = [str(path.relative_to(PACKAGE.parent)) for path in _modules().values() if path.name not in ("__init__.py", "__main__.py")]
    unnamed = [path for path in modules if path not in rows]
    assert not unnamed, f"README's 'Where things live' does not name: {unnamed}"
    twice = {path: names for path, names in rows.items() if len(names) > 1}
    assert not twice, f"named in more than one layer: {twice}"


def test_every_import_runs_down_readmes_layers():
    """A module imports (at module level or lazily) only modules of its own layer and the layers below it; a
    package's __init__ is in the layer of its modules, the top package `polar_mitm` (its version) is below all."""
    layer_of_path = {path: index for index, (_, named) in enumerate(readme_layers()) for path in named}
    modules = _modules()

    def layer(module: str) -> int | None:
        path = modules[module]
        if module == "polar_mitm":
            return None
        relative = str(path.relative_to(PACKAGE.parent))
        if path.name == "__init__.py":
            folder = relative.rsplit("/", 1)[0] + "/"
            inside = [index for named, index in layer_of_path.items() if named.startswith(folder)]
            return min(inside) if inside else None
        return layer_of_path.get(relative)

    names = [name for name, _ in readme_layers()]
    upward = []
    for module, path in modules.items():
        for target in _all_imports(path):
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if not target or target == module:
                continue
            here, there = layer(module), layer(target)
            if here is not None and there is not None and there < here:
                upward.append(f"{module} ({names[here]}) -> {target} ({names[there]})")
    assert not upward, "imports that run up README's layers:\n" + "\n".join(sorted(set(upward)))
