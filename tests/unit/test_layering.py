"""The package's layers, read from its source (imports as text; ``if TYPE_CHECKING:`` blocks left out).

1. Names come from their homes: no module of the package imports a name from a module that only re-exports
   it, and no module but a package face (``__init__.py``, which collects names and may be imported from)
   lists in its ``__all__`` a name it does not define.
2. No import cycle among the package's modules.
3. The loss path in layers, bottom up: each of its modules imports only modules of lower layers (no upward
   import), and nothing of the integrations, the trainer, the data or the eval packages.
4. The applications (``launch/``, ``benchmarks/``, ``experiments/``) import nothing from ``tests/``.
"""

from __future__ import annotations

import ast
import pathlib

import ntl_scale

PACKAGE = pathlib.Path(ntl_scale.__file__).parent

PENDING: set[str] = set()

LAYERS = [  # bottom up; ops.* is the op layer, under the functional layer (terms, reductions, losses, linear)
    {"options", "_runtime", "atomic", "ops.triton_ce_ntl", "ops.shards"},
    {"number_vocab", "ops.shard_math"},
    {"_validation", "ops.logits"},
    {"ops.chunked_linear", "terms"},
    {"reductions", "normalization"},
    {"losses", "linear"},
]  # fmt: skip


def _modules() -> dict[str, pathlib.Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


MODULES = _modules()


def _imports(module: str) -> list[tuple[str, str | None, int]]:
    """``(imported module, name or None, line)`` for each import of a package module by ``module``."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    tree = ast.parse(path.read_text(encoding="utf-8"))
    typing_only = {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for stmt in node.body
        for inner in ast.walk(stmt)
    }
    found: list[tuple[str, str | None, int]] = []
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            found += [(alias.name, None, node.lineno) for alias in node.names if alias.name in MODULES]
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            source = ".".join(base + ([node.module] if node.module else []))
            for alias in node.names:
                if f"{source}.{alias.name}" in MODULES:  # a submodule: ``from . import chunked``
                    found.append((f"{source}.{alias.name}", None, node.lineno))
                elif source in MODULES:
                    found.append((source, alias.name, node.lineno))
    return found


def _defined(module: str) -> set[str]:
    """The names ``module`` defines itself (functions, classes, assignments), not those it imports."""
    names = set()
    for node in ast.parse(MODULES[module].read_text(encoding="utf-8")).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    return names


def _face(module: str) -> bool:
    return MODULES[module].name == "__init__.py"


def test_names_are_imported_from_their_homes_not_from_a_re_export():
    """In particular no package module imports from ``losses.py`` a name that it only re-exports."""
    defined = {module: _defined(module) for module in MODULES}
    found = []
    for module in sorted(MODULES):
        if _face(module) or module in PENDING:
            continue
        for source, name, line in _imports(module):
            if name is not None and not _face(source) and name not in defined[source]:
                found.append(f"{MODULES[module].relative_to(PACKAGE.parent)}:{line}: {name} from {source}")
    assert not found, "import these names from the module that defines them:\n" + "\n".join(found)


def test_only_package_faces_re_export():
    """A module's ``__all__`` lists what it defines (no compatibility re-exports); ``__init__.py`` collects."""
    import importlib

    found = []
    for module in sorted(MODULES):
        if _face(module):
            continue
        exported = getattr(importlib.import_module(module), "__all__", [])
        found += [f"{module}.{name}" for name in exported if name not in _defined(module)]
    assert not found, "re-exported outside a package face: " + ", ".join(found)


def test_no_import_cycle():
    graph = {module: {source for source, _, _ in _imports(module) if source != module} for module in MODULES}
    state: dict[str, int] = {}
    cycles = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for source in sorted(graph[module]):
            if state.get(source) == 1:
                cycles.append(" -> ".join([*path[path.index(source) :], source]))
            elif source not in state:
                visit(source, [*path, source])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not cycles, cycles


def test_the_loss_path_imports_only_lower_layers():
    layer_of = {f"ntl_scale.{name}": i for i, layer in enumerate(LAYERS) for name in layer}
    assert set(layer_of) <= set(MODULES), set(layer_of) - set(MODULES)
    loss_path = {
        m for m in MODULES if not _face(m) and m.split(".")[1] not in ("integrations", "training", "data", "eval")
    }
    assert loss_path <= set(layer_of), "place new modules in LAYERS"
    found = []
    for module, layer in sorted(layer_of.items()):
        for source, _, line in _imports(module):
            if source != module and layer_of.get(source, len(LAYERS)) >= layer:
                found.append(f"{module}:{line} (layer {layer}) imports {source} (layer {layer_of.get(source, '-')})")
    assert not found, "\n".join(found)


def test_applications_import_nothing_from_tests():
    root = PACKAGE.parent
    found = []
    for folder in ("launch", "benchmarks", "experiments"):
        for path in sorted((root / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
                names += [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
                found += [f"{path.relative_to(root)}:{node.lineno}: {n}" for n in names if n.split(".")[0] == "tests"]
    assert not found, "move what they need into the package or benchmarks/common.py:\n" + "\n".join(found)
