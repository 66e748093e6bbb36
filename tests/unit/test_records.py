"""A record behaves as the dataclass of the same declaration, and is built only when first used."""

from __future__ import annotations

import copy
import dataclasses
import inspect
import pickle
import subprocess
import sys
import threading
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from quotawrap.core.records import Record, built

# How a generated field is declared: (source after the annotation, value to pass, the default value)
KINDS = {
    "required": ("", None),
    "default": (" = 7", 7),
    "factory_list": (" = field(default_factory=list)", []),
    "factory_tuple": (" = field(default_factory=tuple)", ()),
    "uncompared": (" = field(default=3, compare=False)", 3),
    "unshown": (" = field(default=4, repr=False)", 4),
    "unhashed": (" = field(default=5, hash=False)", 5),
    "not_init": (" = field(default=6, init=False)", 6),
}


def _declare(base: str, frozen: bool, kinds: list[str], post_init: bool) -> type:
    """The class `Shape` declared on `base` ("record" or "dataclass") with these fields."""
    kinds = sorted(kinds, key=lambda kind: kind != "required")  # no default after a default
    lines = [f"class Shape(Record{', frozen=True' if frozen else ''}):" if base == "record" else "class Shape:"]
    if base == "dataclass":
        lines.insert(0, f"@dataclass(frozen={frozen})")
    for index, kind in enumerate(kinds):
        lines.append(f"    f{index}: {'list[int]' if kind == 'factory_list' else 'object'}{KINDS[kind][0]}")
    if post_init:
        lines += ["    def __post_init__(self):", "        object.__setattr__(self, 'seen', True)"]
    lines.append("    pass")
    namespace: dict[str, Any] = {"Record": Record, "dataclass": dataclasses.dataclass, "field": dataclasses.field}
    exec("\n".join(lines), namespace)
    shape: type = namespace["Shape"]
    return shape


def _arguments(kinds: list[str], values: list[int]) -> tuple[list[Any], dict[str, Any]]:
    kinds = sorted(kinds, key=lambda kind: kind != "required")
    positional: list[Any] = []
    named: dict[str, Any] = {}
    for index, (kind, value) in enumerate(zip(kinds, values, strict=False)):
        if kind == "required":
            positional.append(value)
        elif kind != "not_init" and value % 2:  # some defaults given by name, some left
            named[f"f{index}"] = [value] if kind == "factory_list" else value
    return positional, named


def _outcome(action: Any, *args: Any) -> Any:
    try:
        return ("value", action(*args))
    except Exception as exc:
        return ("raised", type(exc))


shapes = st.tuples(
    st.booleans(),
    st.lists(st.sampled_from(sorted(KINDS)), max_size=6),
    st.booleans(),
    st.lists(st.integers(-3, 3), min_size=6, max_size=6),
    st.lists(st.integers(-3, 3), min_size=6, max_size=6),
)


@given(shapes)
def test_a_record_behaves_as_the_dataclass_of_its_declaration(
    shape: tuple[bool, list[str], bool, list[int], list[int]],
) -> None:
    frozen, kinds, post_init, values, other_values = shape
    record, dataclass = _declare("record", frozen, kinds, post_init), _declare("dataclass", frozen, kinds, post_init)
    assert not built(record)
    assert str(inspect.signature(record)) == str(inspect.signature(dataclass))
    assert built(record)
    assert record.__doc__ == dataclass.__doc__
    assert [f.name for f in dataclasses.fields(record)] == [f.name for f in dataclasses.fields(dataclass)]
    assert record.__match_args__ == dataclass.__match_args__  # type: ignore[attr-defined]

    args, kwargs = _arguments(kinds, values)
    other_args, other_kwargs = _arguments(kinds, other_values)
    mine, theirs = record(*args, **kwargs), dataclass(*args, **kwargs)
    mine_other, theirs_other = record(*other_args, **other_kwargs), dataclass(*other_args, **other_kwargs)
    assert vars(mine) == vars(theirs)
    assert repr(mine) == repr(theirs)
    assert dataclasses.asdict(mine) == dataclasses.asdict(theirs)
    assert (mine == mine_other) == (theirs == theirs_other)
    assert (mine == record(*args, **kwargs)) is (theirs == dataclass(*args, **kwargs)) is True
    assert (mine == theirs) is False  # another class, as two dataclasses are
    hashed_mine, hashed_theirs = _outcome(hash, mine), _outcome(hash, theirs)
    assert hashed_mine[0] == hashed_theirs[0]
    if hashed_mine[0] == "value" and mine == mine_other:
        assert hash(mine) == hash(mine_other)
    for action in (lambda o: setattr(o, "f0", 1), lambda o: delattr(o, "f0"), lambda o: setattr(o, "extra", 1)):
        changed_mine, changed_theirs = record(*args, **kwargs), dataclass(*args, **kwargs)
        assert _outcome(action, changed_mine)[0] == _outcome(action, changed_theirs)[0]
        assert vars(changed_mine) == vars(changed_theirs)
    assert vars(dataclasses.replace(mine, **other_kwargs)) == vars(dataclasses.replace(theirs, **other_kwargs))
    assert vars(copy.copy(mine)) == vars(copy.copy(theirs)) and copy.deepcopy(mine) == mine


class Pickled(Record, frozen=True):
    """A record at module level, so that pickle finds it by name."""

    amount: int
    note: str = ""


class Raced(Record, frozen=True):
    amount: int


def test_a_record_is_built_once_by_racing_threads() -> None:
    assert not built(Raced)
    made: list[Raced] = []
    start = threading.Barrier(16)

    def make() -> None:
        start.wait()
        made.extend(Raced(index) for index in range(200))

    threads = [threading.Thread(target=make) for _ in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(made) == 16 * 200 and built(Raced)
    assert sorted({item.amount for item in made}) == list(range(200)) and Raced(3) == Raced(3)


def test_unpickling_before_any_instance_builds_the_record() -> None:
    """Another process unpickles a record it has never made: the class is built, equality works."""
    data = pickle.dumps(Pickled(5, "x"))
    code = (
        "import pickle, sys; from tests.unit.test_records import Pickled; from quotawrap.core.records import built;"
        f"assert not built(Pickled); p = pickle.loads({data!r});"
        "assert built(Pickled) and p == Pickled(5, 'x') and hash(p) == hash(Pickled(5, 'x')), p; print(repr(p))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "Pickled(amount=5, note='x')"


def test_a_record_refuses_what_it_does_not_mirror() -> None:
    with pytest.raises(TypeError, match="inherits from Record alone"):

        class Child(Pickled):  # type: ignore[misc]
            extra: int = 0

    class Kw(Record):
        amount: int = dataclasses.field(default=0, kw_only=True)

    with pytest.raises(TypeError, match="kw_only"):
        Kw()


def test_importing_the_guard_builds_only_what_it_makes() -> None:
    """A guarded child imports the guard on its first call: its records wait until they are used, but
    for the three its modules make at import (default settings, the built-in price table)."""
    code = (
        "import quotawrap.admission.guard, quotawrap.ledger.sqlite.ledger\n"
        "from quotawrap.core.records import Record, built\n"
        "kinds = Record.__subclasses__()\n"
        "assert len(kinds) > 20, kinds\n"
        "print(sorted(kind.__qualname__ for kind in kinds if built(kind)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "['EstimateSettings', 'ModelPrice', 'Tier']"


def test_an_undocumented_record_reads_as_its_dataclass_before_it_is_built() -> None:
    kinds = ["required", "factory_list", "default"]
    record, dataclass = _declare("record", True, kinds, False), _declare("dataclass", True, kinds, False)
    assert not built(record)
    assert record.__doc__ == dataclass.__doc__ and "f1: 'list[int]' = <factory>" in str(record.__doc__)
