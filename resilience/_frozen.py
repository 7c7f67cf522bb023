"""``quick_init``: a faster ``__init__`` for the frozen, slotted dataclasses built on every call.

A frozen dataclass's generated ``__init__`` sets each field with
``object.__setattr__(self, "name", value)`` (its own ``__setattr__`` refuses),
about 0.15 us a field. The retry core builds several such objects on every
call (the call spec, the attempt's result and record, the events when
observed). ``quick_init`` replaces that ``__init__`` with one that sets each
slot through the class's own slot descriptor (``Cls.name.__set__``), about
2.5 times faster, derived from the dataclass's fields: the same parameters in
the same order, the same defaults and default factories, keyword-only fields
kept keyword-only. Everything else (frozen ``__setattr__``, ``__eq__``,
``__hash__``, ``__repr__``, ``replace``) is the dataclass's own.
``tests/core/test__frozen.py`` checks each decorated class against a plain
dataclass twin.

Apply it on top of ``@dataclass(frozen=True, slots=True)``; a class with a
``__post_init__``, an ``InitVar`` or a field left out of ``__init__`` is
refused (``TypeError``), since the generated code would skip it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

__all__ = ["quick_init"]

T = TypeVar("T")

_FACTORY = object()
"""The default of a field with a ``default_factory``: the factory is called when the caller passed nothing."""


def quick_init(cls: type[T]) -> type[T]:
    """``cls`` with a faster ``__init__`` (see the module); ``cls`` must be a frozen, slotted dataclass."""
    params = getattr(cls, "__dataclass_params__", None)
    if params is None or not params.frozen or "__slots__" not in cls.__dict__:
        raise TypeError(f"quick_init: {cls.__qualname__} must be a @dataclass(frozen=True, slots=True)")
    if hasattr(cls, "__post_init__"):
        raise TypeError(f"quick_init: {cls.__qualname__} has a __post_init__, which the fast __init__ would skip")
    every = getattr(cls, "__dataclass_fields__", {})
    if any(f._field_type is not dataclasses._FIELD for f in every.values()):  # type: ignore[attr-defined]
        raise TypeError(f"quick_init: {cls.__qualname__} has an InitVar or ClassVar pseudo-field")
    fields = dataclasses.fields(cls)  # type: ignore[arg-type]
    if any(not f.init for f in fields):
        raise TypeError(f"quick_init: {cls.__qualname__} has a field left out of __init__")
    namespace: dict[str, Any] = {"_FACTORY": _FACTORY}
    positional: list[str] = []
    keyword: list[str] = []
    body: list[str] = []
    for i, f in enumerate(fields):
        namespace[f"_set{i}"] = cls.__dict__[f.name].__set__
        param = f.name
        value = f.name
        if f.default is not dataclasses.MISSING:
            namespace[f"_default{i}"] = f.default
            param += f"=_default{i}"
        elif f.default_factory is not dataclasses.MISSING:
            namespace[f"_factory{i}"] = f.default_factory
            param += "=_FACTORY"
            value = f"_factory{i}() if {f.name} is _FACTORY else {f.name}"
        (keyword if f.kw_only else positional).append(param)
        body.append(f"    _set{i}(self, {value})")
    signature = ", ".join(["self", *positional, *(["*", *keyword] if keyword else [])])
    source = f"def __init__({signature}):\n" + ("\n".join(body) or "    pass") + "\n"
    exec(source, namespace)
    init = namespace["__init__"]
    init.__qualname__ = f"{cls.__qualname__}.__init__"
    init.__module__ = cls.__module__
    init.__doc__ = cls.__init__.__doc__
    cls.__init__ = init  # type: ignore[method-assign]
    return cls
