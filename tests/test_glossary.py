"""One word, one meaning, checked from the source the way `test_layers.py` checks the layers.

The glossary of `docs/design.md` ("One word, one meaning") is a list of entries, each
`- **word** (`Pattern`, ... in `module`, ...): meaning`, the meaning running on over indented
lines. A pattern is a class or type-alias name: `Compressing` governs that name exactly, `*Plan`
every name that ends in `Plan` (`CallPlan`, `ScatterPlan`; not `Planner`, not `PlanB`). The
modules are dotted names, each a module or a package (which takes in everything under it), or
`no module` where no class may bear the word at all.

Every module of `src/dataparallel` is parsed with `ast`; a definition is a class (nested ones
too), an annotated `X: TypeAlias = ...`, a `type X = ...`, or a module-level assignment of a
capitalized name to a type expression (`X = Literal[...]`, `X = A | B`, `X = Callable[...]`,
`X = TypeVar(...)`). A definition that a pattern governs must stand in one of its entry's modules.
So a reader who meets `Bucket` or `*Plan` in two files finds the same thing, and a new meaning
for an old word fails here until it gets a word of its own.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass

import pytest
from _jobs import outer_world_size
from _source import MODULES, ROOT

# The source is the same in every world: several ranks would each read it and prove nothing more.
pytestmark = pytest.mark.skipif(
    outer_world_size() > 1, reason="reads the source: runs in the world of one"
)


DESIGN = ROOT / "docs" / "design.md"

# The words decided for the whole house: the glossary must keep an entry for each.
DECIDED = {"plan", "route", "bucket", "flat", "request", "engine", "backend"}

ENTRY = re.compile(
    r"^- \*\*(?P<word>[^*]+)\*\* \((?P<patterns>.+?) in (?P<where>.+?)\):(?P<meaning>.*)$"
)
TYPE_FACTORIES = {"TypeVar", "NewType", "ParamSpec", "TypeVarTuple"}


@dataclass(frozen=True)
class Entry:
    word: str
    patterns: tuple[str, ...]
    modules: tuple[str, ...]  # empty: no module may define a name the patterns govern
    meaning: str

    def governs(self, name: str) -> bool:
        for pattern in self.patterns:
            if pattern.startswith("*"):
                if name.endswith(pattern[1:]):
                    return True
            elif name == pattern:
                return True
        return False

    def allows(self, module: str) -> bool:
        return any(module == m or module.startswith(m + ".") for m in self.modules)


def glossary() -> list[Entry]:
    """Parse the glossary section of docs/design.md into its entries."""
    lines = DESIGN.read_text(encoding="utf-8").splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("One word, one meaning"))
    entries: list[Entry] = []
    for line in lines[start + 1 :]:
        if not line.strip():
            break
        if line.startswith("  ") and entries:  # the meaning runs on
            last = entries[-1]
            entries[-1] = Entry(
                last.word, last.patterns, last.modules, f"{last.meaning} {line.strip()}".strip()
            )
            continue
        match = ENTRY.match(line)
        if match is None:
            assert not line.startswith("- "), f"a glossary entry this test cannot read: {line!r}"
            continue  # the section's introduction
        patterns = tuple(re.findall(r"`([^`]+)`", match["patterns"]))
        where = match["where"].strip()
        modules = () if where == "no module" else tuple(re.findall(r"`([^`]+)`", where))
        entries.append(Entry(match["word"].strip(), patterns, modules, match["meaning"].strip()))
    return entries


def _is_type_expression(value: ast.expr) -> bool:
    if isinstance(value, ast.Subscript):
        return True
    if isinstance(value, ast.BinOp) and isinstance(value.op, ast.BitOr):
        return True
    if isinstance(value, ast.Call):
        func = value.func
        name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")
        return name in TYPE_FACTORIES
    return False


def _module_statements(body: list[ast.stmt]) -> list[ast.stmt]:
    """The module's own statements, those under `if TYPE_CHECKING:` and `try:` included."""
    found: list[ast.stmt] = []
    for node in body:
        found.append(node)
        if isinstance(node, ast.If):
            found += _module_statements(node.body) + _module_statements(node.orelse)
        elif isinstance(node, ast.Try):
            found += _module_statements(node.body)
            for handler in node.handlers:
                found += _module_statements(handler.body)
    return found


def definitions(name: str) -> list[str]:
    """Return the classes and type aliases module `name` defines."""
    tree = ast.parse(MODULES[name].read_text(encoding="utf-8"))
    found = [node.name for node in ast.walk(tree) if isinstance(node, ast.ClassDef)]
    for node in _module_statements(tree.body):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            annotation = node.annotation
            kind = annotation.id if isinstance(annotation, ast.Name) else ""
            kind = annotation.attr if isinstance(annotation, ast.Attribute) else kind
            if kind == "TypeAlias":
                found.append(node.target.id)
        elif isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
            if (
                isinstance(target, ast.Name)
                and target.id.lstrip("_")[:1].isupper()
                and not target.id.isupper()
                and _is_type_expression(node.value)
            ):
                found.append(target.id)
        elif type(node).__name__ == "TypeAlias":  # `type X = ...` (Python 3.12)
            found.append(node.name.id)  # type: ignore[attr-defined]
    return found


def test_the_glossary_reads_and_keeps_the_house_words() -> None:
    entries = glossary()
    words = [entry.word for entry in entries]
    assert len(words) == len(set(words)), f"a word with two entries: {sorted(words)}"
    assert set(words) >= DECIDED, f"words the glossary lost: {sorted(DECIDED - set(words))}"
    for entry in entries:
        assert entry.patterns, f"{entry.word}: no class or alias name to govern"
        assert entry.meaning, f"{entry.word}: no meaning"


def test_the_glossary_names_modules_that_exist() -> None:
    missing = [
        f"{entry.word}: {module}"
        for entry in glossary()
        for module in entry.modules
        if module not in MODULES
    ]
    assert missing == []


def test_every_governed_name_is_defined_only_where_the_glossary_says() -> None:
    entries = glossary()
    offences = []
    for module in MODULES:
        for name in definitions(module):
            for entry in entries:
                if entry.governs(name) and not entry.allows(module):
                    where = ", ".join(entry.modules) or "no module"
                    offences.append(f"{module}.{name}: '{entry.word}' is defined in {where}")
    assert offences == []


def test_the_rules_of_this_test() -> None:
    plan = Entry("plan", ("*Plan",), ("dataparallel.collectives",), "how a call runs")
    assert plan.governs("CallPlan") and plan.governs("Plan")
    assert not plan.governs("Planner") and not plan.governs("PlanB")
    assert plan.allows("dataparallel.collectives._plans")
    assert not plan.allows("dataparallel.collectives_old")
    exact = Entry("compressor", ("Compressing",), ("dataparallel.arrays.compression",), "x")
    assert exact.governs("Compressing") and not exact.governs("NotCompressing")
    nowhere = Entry("engine", ("*Engine",), (), "a communication library")
    assert nowhere.governs("Engine") and not nowhere.allows("dataparallel.backends.half")
