"""An exchange written once as steps without I/O, and its one driver for sync and async clients alike.

A loop that asks an engine again (SGLang's ``flush_cache`` after "not idle", vLLM's refusals asked again, a vLLM weight
push) is a generator: it yields a step (a request to send, seconds to wait, a client call) and is sent back the step's
``Reply``: ``(value, None)``, or ``(None, error)`` when it raised. The generator decides what an answer or an error
means; ``drive`` only performs the steps, so the sync and async clients differ only in ``await``:

- an async client: ``await drive(steps, perform)``;
- a sync client: ``run_now(drive(steps, perform))`` (its ``perform`` returns plain
  values, so the coroutine never suspends).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Coroutine, Generator
from types import CoroutineType
from typing import Any, TypeVar

__all__ = ["Reply", "Steps", "drive", "run_now", "value_of"]

S = TypeVar("S")
T = TypeVar("T")

Reply = tuple[Any, Exception | None]
"""What a step gave: ``(value, None)``, or ``(None, error)`` when performing it raised."""

Steps = Generator[S, Reply, T]
"""An exchange as steps: yields steps ``S``, is sent each one's ``Reply``, returns ``T``."""


async def drive(steps: Steps[S, T], perform: Callable[[S], Any]) -> T:
    """Perform each step (``perform(step)``: a value, or an awaitable of one) and send back its ``Reply``; return the result.

    An ``Exception`` a step raised goes back to ``steps`` (which raises it, or another, or carries on);
    whatever ``steps`` raises comes out here. On any exit the generator is closed here, in this context
    (a ``Deadline`` it holds is left where it was entered, also on cancellation).
    """
    try:
        reply: Reply | None = None
        while True:
            try:
                step = next(steps) if reply is None else steps.send(reply)
            except StopIteration as done:
                result: T = done.value  # an annotation, not ``typing.cast``: that is a function call, on every call
                return result
            try:
                value = perform(step)
                awaitable = type(value) is CoroutineType or inspect.isawaitable(value)  # the type test first: no call for a coroutine
                reply = (await value if awaitable else value, None)
            except Exception as exc:
                reply = (None, exc)
    finally:
        steps.close()


def run_now(coroutine: Coroutine[Any, Any, T]) -> T:
    """The result of a coroutine that never suspends (``drive`` over a sync client); RuntimeError when it does."""
    try:
        coroutine.send(None)
    except StopIteration as done:
        result: T = done.value
        return result
    coroutine.close()
    raise RuntimeError("a sync client's step returned an awaitable")


def value_of(reply: Reply) -> Any:
    """The reply's value; the error it carries, raised."""
    value, error = reply
    if error is not None:
        raise error
    return value
