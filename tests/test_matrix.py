"""The `matrix` marker's sample (conftest.covering_sample): what every world but the full one runs.

The sample must hold every pair of values that the whole matrix holds, and be the same however
often it is drawn (every rank draws it alone and must collect the same tests). A `heavy` test's
cases (conftest.heavy_elsewhere) each run on both engines and at both sizes; a `spread` test's
cases each run in one multi-rank world, and its first two on both engines at both sizes.
"""

from __future__ import annotations

import itertools
from types import SimpleNamespace
from typing import Any

from _families import FAMILIES, OPS
from conftest import HEAVY_WORLDS, TURNS, covering_sample, heavy_elsewhere


def cases(**axes: Any) -> list[Any]:
    """Fake collected items: one per case of the product of `axes`, in collection order."""
    names = list(axes)
    return [
        SimpleNamespace(callspec=SimpleNamespace(params=dict(zip(names, values, strict=True))))
        for values in itertools.product(*axes.values())
    ]


def held(items: list[Any], strength: int) -> set[Any]:
    out = set()
    for item in items:
        values = sorted((k, repr(v)) for k, v in item.callspec.params.items())
        out |= set(itertools.combinations(values, strength))
    return out


def test_every_pair_of_family_dtype_and_op_is_held() -> None:
    items = [
        SimpleNamespace(callspec=SimpleNamespace(params={"family": f, "dtype": d, "op": op}))
        for f in FAMILIES
        for d in f.dtypes
        for op in OPS
    ]
    sample = covering_sample(items, 2)
    assert held(sample, 2) == held(items, 2)
    assert len(sample) < len(items) / 3
    runnable = [i for i in items if i.callspec.params["family"].skip_reason() is None]
    assert held([i for i in sample if i in runnable], 2) == held(runnable, 2)


def test_strength_one_holds_every_value_and_the_sample_is_the_same_every_time() -> None:
    items = cases(op=OPS, scale=[None, 0.5, 3.0, -2.0])
    sample = covering_sample(items, 1)
    assert held(sample, 1) == held(items, 1) and len(sample) == len(OPS)
    assert [id(i) for i in covering_sample(items, 1)] == [id(i) for i in sample]
    assert covering_sample(items, 2) == items  # with two axes, every pair is every case


def test_each_case_of_a_heavy_test_runs_on_both_engines_at_both_sizes() -> None:
    def item(nodeid: str, heavy: bool = True) -> Any:
        return SimpleNamespace(
            nodeid=nodeid, get_closest_marker=lambda name: (heavy and name == "heavy") or None
        )

    items = [item("t.py::a[eager]"), item("t.py::a[jit]"), item("t.py::b"), item("t.py::c", False)]
    kept = {}
    for worlds in HEAVY_WORLDS:
        assert {engine for engine, _ in worlds} == {"mpi", "gloo"}
        assert {size for _, size in worlds} == {2, 3}
        for here in worlds:
            gone = heavy_elsewhere(items, here)
            kept[here] = [i.nodeid for i in items if id(i) not in gone]
    assert kept[("mpi", 3)] == kept[("gloo", 2)] == ["t.py::a[eager]", "t.py::b", "t.py::c"]
    assert kept[("mpi", 2)] == kept[("gloo", 3)] == ["t.py::a[jit]", "t.py::c"]
    assert heavy_elsewhere(items, ("single", 1)) == heavy_elsewhere(items, ("mpi", 4)) == set()


def test_the_cases_of_a_spread_test_take_the_worlds_in_turn() -> None:
    def item(nodeid: str, marker: str | None) -> Any:
        return SimpleNamespace(
            nodeid=nodeid, get_closest_marker=lambda name: name == marker or None
        )

    ids = [f"t.py::a[{n}]" for n in range(5)] + ["t.py::b", "t.py::c[x]", "t.py::c[y]"]
    ids += ["t.py::d[eager]", "t.py::d[jit]"]
    markers = ["spread"] * 6 + ["heavy"] * 2 + ["spread"] * 2
    items = [item(nodeid, marker) for nodeid, marker in zip(ids, markers, strict=True)]
    kept = {here: [i.nodeid for i in items if id(i) not in heavy_elsewhere(items, here)]
            for here in TURNS}  # fmt: skip
    for first, second in (TURNS[:2], TURNS[2:]):
        assert {first[0], second[0]} == {"mpi", "gloo"} and {first[1], second[1]} == {2, 3}
    assert TURNS[0][0] == TURNS[3][0] != TURNS[1][0] == TURNS[2][0]  # both orders of engines
    assert kept[TURNS[0]] == ["t.py::a[0]", "t.py::a[4]", "t.py::b", "t.py::c[x]"]
    assert kept[TURNS[1]] == ["t.py::a[1]", "t.py::b", "t.py::c[x]"]
    assert kept[TURNS[2]] == ["t.py::a[2]", "t.py::c[y]", "t.py::d[eager]"]
    assert kept[TURNS[3]] == ["t.py::a[3]", "t.py::c[y]", "t.py::d[jit]"]
