"""The shape of the house, checked from the source: layers and no import cycle.

Every module of `src/dataparallel` is parsed with `ast` and every import it makes is an edge of the
graph, wherever it stands (top level, inside a function, under `TYPE_CHECKING`): a lazy import is
still an arrow. The rules of `docs/design.md`:

- each module belongs to a layer, and imports only from its own layer or the ones below;
- no cycle among modules, within a layer either;
- no module imports another module's private names, and a private module (`_name.py`) is imported
  only from the package that holds it (its subpackages included);
- inside `backends/`, a framework appears only where the engine is that framework's own (Gloo is
  torch's, NCCL is reached through CuPy, MPI through mpi4py); an entry names a module or a package;
- the word `Any` appears at most `ANY_CEILING` times in the source, counted as
  `git grep -ow Any -- 'src/*.py'` counts it (imports and prose included): a type that says
  nothing is the exception, so a new one displaces an old one.
"""

from __future__ import annotations

import ast
import importlib
import re
import sys

import pytest
from _jobs import outer_world_size
from _source import MODULES, ROOT

# The source is the same in every world: several ranks would each read it and prove nothing more.
pytestmark = pytest.mark.skipif(
    outer_world_size() > 1, reason="reads the source: runs in the world of one"
)


# Bottom to top. A module's layer is that of the longest prefix listed here.
LAYERS: list[tuple[str, ...]] = [
    (
        "dataparallel.config",
        "dataparallel.errors",
        "dataparallel.types",
        "dataparallel.runnotes",
        "dataparallel.caches",
        "dataparallel.version",
        "dataparallel.slurm",
        "dataparallel.gpus",
    ),
    ("dataparallel.backends",),
    ("dataparallel.arrays",),
    (
        "dataparallel.world",
        "dataparallel.startup",
        "dataparallel.groups",
        "dataparallel.torch_distributed",
    ),
    (
        "dataparallel.protocol",
        "dataparallel.protocol_report",
        "dataparallel.collectives",
        "dataparallel.reducers",
    ),
    (
        "dataparallel.torch",
        "dataparallel.jax",
        "dataparallel.data",
        "dataparallel.elastic",
        "dataparallel.progress",
    ),
    ("dataparallel.training", "dataparallel.checkpoint"),
    # Horovod's API over the public face's calls; Lightning's strategy over the same
    ("dataparallel.horovod", "dataparallel.lightning"),
    ("dataparallel.launch", "dataparallel.__main__"),
    ("dataparallel",),  # the public face, __init__.py
]
FRAMEWORKS = {"torch", "jax", "jaxlib", "optax", "cupy", "cupyx", "mpi4py"}
BACKEND_FRAMEWORKS = {
    "dataparallel.backends.gloo": {"torch"},
    "dataparallel.backends.mpi": {"mpi4py"},
    "dataparallel.backends.nccl": {"cupy"},
}


def imports_of(name: str) -> list[tuple[str, str | None]]:
    """Return (module, imported name or None) for every import in module `name`."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: list[tuple[str, str | None]] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(alias.name, None) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                found.append((submodule, None) if submodule in MODULES else (base, alias.name))
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            found.append((node.args[0].value, None))
    return found


def layer_of(name: str) -> int:
    best, layer = -1, -1
    for index, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (name == prefix or name.startswith(prefix + ".")) and len(prefix) > best:
                best, layer = len(prefix), index
    assert layer >= 0, f"{name} is in no layer: add it to LAYERS and to docs/design.md"
    return layer


def internal_edges() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {name: set() for name in MODULES}
    for name in MODULES:
        for target, _ in imports_of(name):
            if target in MODULES and target != name:
                edges[name].add(target)
    return edges


def test_every_module_imports_in_layer_order() -> None:
    for name in sorted(MODULES, key=layer_of):
        if name.startswith("dataparallel.jax"):
            pytest.importorskip("jax")
        if name.startswith("dataparallel.torch"):
            pytest.importorskip("torch")
        if name == "dataparallel.lightning":
            pytest.importorskip("pytorch_lightning")
        importlib.import_module(name)
        assert name in sys.modules


def test_arrows_point_down() -> None:
    upward = [
        f"{source} (layer {layer_of(source)}) imports {target} (layer {layer_of(target)})"
        for source, targets in internal_edges().items()
        for target in targets
        if layer_of(target) > layer_of(source)
    ]
    assert upward == []


def test_no_import_cycle() -> None:
    edges = internal_edges()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles: list[list[str]] = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for target in sorted(edges[node]):
            if state.get(target) == 1:
                cycles.append([*path[path.index(target) :], target])
            elif target not in state:
                visit(target, [*path, target])
        state[node] = 2

    for name in sorted(edges):
        if name not in state:
            visit(name, [name])
    assert cycles == []


def test_no_module_reaches_into_another_s_privates() -> None:
    offences = []
    for name in MODULES:
        package = name if MODULES[name].name == "__init__.py" else name.rpartition(".")[0]
        for target, imported in imports_of(name):
            if not target.startswith("dataparallel"):
                continue
            if imported is not None and imported.startswith("_"):
                offences.append(f"{name} imports the private name {target}.{imported}")
            parts = target.split(".")
            private = [i for i, p in enumerate(parts) if p.startswith("_") and p != "__main__"]
            # A private module belongs to the package that holds it, subpackages included.
            owner = ".".join(parts[: private[0]]) if private else ""
            if private and not (package == owner or package.startswith(owner + ".")):
                offences.append(f"{name} imports the private module {target}")
    assert offences == []


def test_backends_name_no_framework_but_their_own() -> None:
    offences = []
    for name in MODULES:
        if not name.startswith("dataparallel.backends"):
            continue
        owners = [key for key in BACKEND_FRAMEWORKS if name == key or name.startswith(key + ".")]
        allowed = BACKEND_FRAMEWORKS[max(owners, key=len)] if owners else set()
        for target, _ in imports_of(name):
            root = target.partition(".")[0]
            if root in FRAMEWORKS and root not in allowed:
                offences.append(f"{name} imports {target}")
    assert offences == []


ANY_CEILING = 150
_ANY = re.compile(r"(?<![A-Za-z0-9_])Any(?![A-Za-z0-9_])")  # git grep -w's notion of a word


def test_any_stays_under_its_ceiling() -> None:
    counts = {
        str(path.relative_to(ROOT)): n
        for path in MODULES.values()
        if (n := len(_ANY.findall(path.read_text())))
    }
    total = sum(counts.values())
    by_file = "\n".join(
        f"{n:5d} {name}" for name, n in sorted(counts.items(), key=lambda item: (-item[1], item[0]))
    )
    assert total <= ANY_CEILING, (
        f"`Any` appears {total} times in src/, more than {ANY_CEILING}. Give the new values a type "
        f"that says what they are (a TypedDict, a Protocol, a TypeVar, `object` for a value only "
        f"passed on), or type an old one. By file:\n{by_file}"
    )
