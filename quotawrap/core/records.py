"""Record classes: dataclasses that cost almost nothing to define.

`dataclasses.dataclass` compiles the methods it generates (six for a frozen class) when the class
is defined. A guarded child imports the guard on its first call, and with it 35 such
classes: compiling them was half of that call's cost. A subclass of `Record` is declared as a
dataclass would be (`frozen=True` as a class keyword; `field(...)` as usual) and behaves as one, but

* it is built on first use: the first instance (unpickling and `copy` included) or the first look at
  its fields (`dataclasses.fields`, `is_dataclass`, `asdict`, `replace`); until then `Record`'s
  `__init__` and `__dataclass_fields__` stand in and build it, and once built its own methods shadow
  them, so an instance costs what a dataclass's does;
* building compiles one function, `__init__`, whose speed matters on every call; `__repr__`,
  `__eq__`, `__hash__` and the frozen `__setattr__`/`__delattr__` are shared functions over the
  class's field names (`operator.attrgetter`), made without the compiler. `dataclasses` itself
  records the fields (`dataclass(init=False, repr=False, eq=False)` compiles nothing).

`tests/unit/test_records.py` proves a record equal to the dataclass of the same declaration on
generated declarations: signature, values, defaults and factories, repr, equality, hashing,
frozenness, `replace`, `fields`, pickling. A record does not inherit from another record, and takes
no `kw_only`, `order` or `InitVar` (the checker would allow them; building refuses them).
"""

from __future__ import annotations

import inspect
import sys
import threading
from collections.abc import Callable
from dataclasses import MISSING, Field, FrozenInstanceError, dataclass, field, fields
from operator import attrgetter
from typing import Any

if sys.version_info >= (3, 11):
    from typing import dataclass_transform
else:  # pragma: no cover - the checker runs on 3.11; the decorator only informs it

    def dataclass_transform(**_: object) -> Callable[[Any], Any]:
        return lambda decorated: decorated


__all__ = ["Record", "built"]


class _Factory:
    """The default a factory-made field shows in a signature, as a dataclass's does."""

    def __repr__(self) -> str:
        return "<factory>"


_FACTORY = _Factory()
_FROZEN = "__record_frozen__"  # in a record class's own __dict__ while it waits to be built
# One lock for every record: building is rare, and a thread that finds a class being built waits.
_building = threading.RLock()


class _SignatureOnFirstLook:
    """Stands in for `__signature__`, which `inspect.signature` reads first: it builds the class and
    answers None, so that inspect goes on to read the built class's own __init__."""

    def __get__(self, instance: object, owner: type) -> None:
        if instance is None:
            _build(owner)


class _SignatureDoc:
    """A record's docstring when it has none, as a dataclass's (``Name(signature)``), written when read:
    inspecting the signature is slow, and each such record is built on a guarded call's path."""

    def __get__(self, instance: object, owner: type) -> str:
        return owner.__name__ + str(inspect.signature(owner)).replace(" -> None", "")


_SIGNATURE_DOC = _SignatureDoc()


class _FieldsOnFirstLook:
    """Stands in for `__dataclass_fields__`: reading it builds the class and answers for the real one."""

    def __get__(self, instance: object, owner: type) -> dict[str, Field[Any]]:
        if owner is Record:  # not a dataclass itself (a dataclass built on it looks here for fields)
            raise AttributeError("__dataclass_fields__")
        built_fields: dict[str, Field[Any]] = _build(owner).__dict__["__dataclass_fields__"]
        return built_fields


def _build(cls: type) -> type:
    with _building:
        frozen = cls.__dict__.get(_FROZEN)
        if frozen is not None:
            # Gone before building: looks at the class while it is built (dataclass reads its
            # signature) must not build it again. Other threads wait for the lock meanwhile.
            delattr(cls, _FROZEN)
            try:
                _build_one(cls, frozen=frozen)
            except BaseException:
                setattr(cls, _FROZEN, frozen)
                raise
    return cls


def _build_one(klass: type, *, frozen: bool) -> None:
    undocumented = klass.__dict__.get("__doc__") is _SIGNATURE_DOC
    if undocumented:
        klass.__doc__ = "-"  # spares dataclass reading a signature while the class is half built
    # The fields, their class defaults, __match_args__; nothing compiled.
    dataclass(init=False, repr=False, eq=False)(klass)
    own = klass.__dict__
    declared = fields(klass)
    for declared_field in declared:
        if declared_field.kw_only is True:
            raise TypeError(f"{klass.__qualname__}.{declared_field.name}: a record takes no kw_only field")
    compared = _getter(tuple(f.name for f in declared if f.compare))
    hashed = _getter(tuple(f.name for f in declared if (f.compare if f.hash is None else f.hash)))
    shown = tuple(f.name for f in declared if f.repr)
    methods: dict[str, Any] = {
        "__init__": _init_function(klass, declared, frozen=frozen),
        "__repr__": _repr_function(shown),
        "__eq__": _eq_function(compared),
    }
    if frozen:
        methods["__setattr__"] = _refuse_assignment
        methods["__delattr__"] = _refuse_deletion
    # dataclass's rule (eq, no unsafe_hash): unless the class hashes its own way, a frozen one hashes
    # by value and a mutable one is unhashable (a class body's __eq__ alone leaves __hash__ None)
    own_hash = own.get("__hash__", MISSING)
    if own_hash is MISSING or (own_hash is None and "__eq__" in own):
        methods["__hash__"] = (lambda self: hash(hashed(self))) if frozen else None
    for name, method in methods.items():
        if name in own and name != "__hash__":
            continue  # the class's own, as a dataclass keeps it
        if method is not None and method not in (_refuse_assignment, _refuse_deletion):  # those are shared
            method.__qualname__ = f"{klass.__qualname__}.{name}"
        setattr(klass, name, method)
    if undocumented:
        klass.__doc__ = _SIGNATURE_DOC  # type: ignore[assignment]


def _getter(names: tuple[str, ...]) -> Callable[[object], tuple[Any, ...]]:
    if len(names) > 1:
        return attrgetter(*names)
    if names:
        single = attrgetter(names[0])
        return lambda obj: (single(obj),)
    return lambda obj: ()


def _init_function(klass: type, declared: tuple[Field[Any], ...], *, frozen: bool) -> Callable[..., None]:
    """The class's __init__, written out for its fields and compiled: it runs on every call."""
    params = ["self"]
    body: list[str] = []
    # A frozen one sets its fields through object.__setattr__, as a dataclass does: writing to
    # self.__dict__ would make the instance's dict a real one, and reading an attribute of such an
    # instance costs more (CPython keeps a fresh instance's attributes inline while __dict__ is unread).
    namespace: dict[str, Any] = {"FACTORY": _FACTORY, "set_field": object.__setattr__}
    annotations: dict[str, Any] = {}
    for declared_field in declared:
        name = declared_field.name
        if declared_field.default is not MISSING:
            namespace[f"default_{name}"] = declared_field.default
            value = default = f"default_{name}"
        elif declared_field.default_factory is not MISSING:
            namespace[f"factory_{name}"] = declared_field.default_factory
            value, default = f"factory_{name}()", "FACTORY"
        else:
            value = default = ""
        if declared_field.init:
            params.append(f"{name}={default}" if default else name)
            annotations[name] = declared_field.type
            value = f"{value} if {name} is FACTORY else {name}" if default == "FACTORY" else name
        elif default != "FACTORY":
            continue  # init=False: its class attribute answers (as dataclass leaves it), or __post_init__ sets it
        body.append(f"  set_field(self, {name!r}, {value})" if frozen else f"  self.{name} = {value}")
    if hasattr(klass, "__post_init__"):
        body.append("  self.__post_init__()")
    source = f"def __init__({', '.join(params)}):\n" + ("\n".join(body) or "  pass") + "\n"
    try:
        exec(compile(source, f"<record {klass.__module__}.{klass.__qualname__}>", "exec"), namespace)
    except SyntaxError as exc:  # a field without a default after one with: as dataclass says it
        raise TypeError(f"{klass.__qualname__}: {exc.msg}") from None
    init: Callable[..., None] = namespace["__init__"]
    init.__annotations__ = {**annotations, "return": None}
    return init


def _repr_function(names: tuple[str, ...]) -> Callable[[object], str]:
    def __repr__(self: object) -> str:
        shown = ", ".join(f"{name}={getattr(self, name)!r}" for name in names)
        return f"{type(self).__qualname__}({shown})"

    return __repr__


def _eq_function(compared: Callable[[object], tuple[Any, ...]]) -> Callable[[object, object], Any]:
    def __eq__(self: object, other: object) -> Any:
        if other.__class__ is self.__class__:
            return compared(self) == compared(other)
        return NotImplemented

    return __eq__


def _refuse_assignment(self: object, name: str, value: object) -> None:
    raise FrozenInstanceError(f"cannot assign to field {name!r}")


def _refuse_deletion(self: object, name: str) -> None:
    raise FrozenInstanceError(f"cannot delete field {name!r}")


def built(cls: type) -> bool:
    """Whether a record class has been built yet (any other class always has)."""
    return _FROZEN not in cls.__dict__


@dataclass_transform(field_specifiers=(field, Field))
class Record:
    """Base of the project's value classes: `class Usage(Record, frozen=True): ...` as a dataclass."""

    def __init_subclass__(cls, *, frozen: bool = False, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.__mro__[1] is not Record:
            raise TypeError(f"{cls.__qualname__}: a record inherits from Record alone")
        setattr(cls, _FROZEN, frozen)
        if cls.__dict__.get("__doc__") is None:
            cls.__doc__ = _SIGNATURE_DOC  # type: ignore[assignment]
        if "__init__" in cls.__dict__:
            _build(cls)  # Record's stand-in would never run: built at once

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # Runs once per class: building gives the class its own __init__, which this then calls.
        _build(type(self))
        type(self).__init__(self, *args, **kwargs)

    def __setstate__(self, state: dict[str, Any]) -> None:
        _build(type(self))  # unpickled (or copied) before any instance was made
        self.__dict__.update(state)


Record.__dataclass_fields__ = _FieldsOnFirstLook()  # type: ignore[attr-defined]
Record.__signature__ = _SignatureOnFirstLook()  # type: ignore[attr-defined]
