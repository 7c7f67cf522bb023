"""``quick_init`` builds the same objects as the dataclass's own ``__init__``, and refuses what it cannot copy."""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import FrozenInstanceError, InitVar, dataclass, field

import pytest

from resilience import events
from resilience._frozen import quick_init
from resilience.outcome import AttemptRecord
from resilience.retry import call, spec


def _twin(cls: type) -> type:
    """A plain frozen slotted dataclass with ``cls``'s fields, defaults and kw_only flags (its own ``__init__``)."""
    specs = []
    for f in dataclasses.fields(cls):
        kwargs: dict[str, object] = {"kw_only": f.kw_only}
        if f.default is not dataclasses.MISSING:
            kwargs["default"] = f.default
        if f.default_factory is not dataclasses.MISSING:
            kwargs["default_factory"] = f.default_factory
        specs.append((f.name, object, field(**kwargs)))  # type: ignore[call-overload]
    return dataclasses.make_dataclass(cls.__name__, specs, frozen=True, slots=True)


DECORATED = [
    AttemptRecord,
    spec.AttemptResult,
    spec.CallSpec,
    events.CallStarted,
    events.AttemptStarted,
    events.AttemptEnded,
    events.RetryScheduled,
    events.CallEnded,
    call.Send,
    call.Wait,
    call.Return,
    call.Raise,
]


@pytest.mark.parametrize("cls", DECORATED, ids=lambda c: c.__name__)
def test_each_decorated_class_takes_the_dataclass_signature_and_sets_every_field(cls: type) -> None:
    """Same parameters (names, order, kinds, defaults); every field set from its argument, or its default when left out."""
    twin = _twin(cls)
    ours, theirs = inspect.signature(cls.__init__), inspect.signature(twin.__init__)  # type: ignore[misc]
    def shape(sig: inspect.Signature) -> list[tuple[str, object, bool]]:
        return [(p.name, p.kind, p.default is not inspect.Parameter.empty) for p in sig.parameters.values()]

    assert shape(ours) == shape(theirs)
    plain = {p.name: p.default for p in theirs.parameters.values() if p.default is not inspect.Parameter.empty}
    for name, default in plain.items():
        if not type(default).__name__.startswith("_HAS_DEFAULT_FACTORY"):
            assert ours.parameters[name].default is default, name
    fields = dataclasses.fields(cls)
    required = {f.name: object() for f in fields if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    built, expected = cls(**required), twin(**required)
    for f in fields:
        assert getattr(built, f.name) == getattr(expected, f.name), f.name
    given = {f.name: object() for f in fields}
    built = cls(**given)
    assert all(getattr(built, name) is value for name, value in given.items())
    with pytest.raises(FrozenInstanceError):
        setattr(built, fields[0].name, 1)


def test_positional_keyword_defaults_and_factories_as_the_dataclass_takes_them() -> None:
    """Positional and keyword calls, a default, a fresh default_factory value per object, keyword-only stays keyword-only."""

    @quick_init
    @dataclass(frozen=True, slots=True)
    class Point:
        x: int
        y: int = 2
        tags: list[int] = field(default_factory=list)
        label: str = field(default="p", kw_only=True)

    a, b = Point(1), Point(1, y=3, tags=[4], label="q")
    assert (a.x, a.y, a.tags, a.label) == (1, 2, [], "p")
    assert (b.x, b.y, b.tags, b.label) == (1, 3, [4], "q")
    assert Point(1).tags is not a.tags  # one new list per object, as the factory gives
    assert a == Point(1) and hash(b.x) == hash(1)
    with pytest.raises(TypeError):
        Point(1, 2, [], "q")  # type: ignore[call-arg]  # label is keyword-only
    with pytest.raises(TypeError):
        Point()  # type: ignore[call-arg]


def test_what_the_fast_init_would_skip_is_refused() -> None:
    """A class that is not frozen and slotted, or has a __post_init__, an InitVar or a field outside __init__: TypeError naming it."""

    @dataclass(frozen=True)
    class NoSlots:
        x: int

    @dataclass(frozen=True, slots=True)
    class Post:
        x: int

        def __post_init__(self) -> None:
            pass

    @dataclass(frozen=True, slots=True)
    class Var:
        x: int
        y: InitVar[int]

    @dataclass(frozen=True, slots=True)
    class Hidden:
        x: int
        y: int = field(default=0, init=False)

    for cls in (NoSlots, Post, Var, Hidden):
        with pytest.raises(TypeError, match=cls.__qualname__):
            quick_init(cls)
