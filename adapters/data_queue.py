"""``DataQueue`` / ``SyncDataQueue``: data requests wait here, in front of the wrapped httpx pool, so that httpcore's own queue stays short.

httpcore's ``AsyncConnectionPool`` and ``ConnectionPool`` (1.0) walk their
whole queue of waiting requests, against every connection, each time a
request starts or its response closes (``_assign_requests_to_connections``):
1,000 streams through 100 connections keep an event loop busy with those
walks, and 64 streaming threads through 16 connections hold the GIL for
them; every other call beside them (a control call on the lane included)
waits for its turn. ``AsyncResilientTransport`` (``DataQueue``) and
``ResilientTransport`` (``SyncDataQueue``) therefore let at most ``limit``
(the pool's ``max_connections``) attempts into the pool at once; the others
wait here, where starting and ending cost O(1). What a user sees:
``docs/http-clients.md`` ("Control calls get a lane of their own").

Both queues keep the same rules:

- Each attempt takes a slot (not each call: a backoff sleep holds none) and
  gives it back once: when its response is closed (``close()`` /
  ``aclose()``, the end of ``client.stream(...)``, a read that fails), when
  the pool raises, or when its caller stops waiting (a cancelled task, an
  interrupted thread); a response never closed keeps its slot, as it keeps
  its connection in httpcore.
- Waiters are served first come first served. A request that waits longer
  than its pool timeout (the ``timeout`` extension's ``pool``; None: no
  limit) gets ``httpx.PoolTimeout``, as from httpcore's queue; once inside,
  a connection is free or can be opened (when the queue is the pool's only
  way in), so httpcore's own wait ends at once.
- Control routes never wait here: they take the lane. With the lane off
  (``DriverConfig(control_lane=None)``) they share the queue, as they would
  share httpcore's.
- ``of`` builds a queue only where it can read the limit; else requests go
  straight to the wrapped transport.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import importlib
import sys
import threading
from collections.abc import AsyncIterator, Awaitable, Iterator, Mapping
from typing import Any

import httpcore
import httpx

__all__ = ["DataQueue", "SyncDataQueue"]


def _pool_timeout(request: httpx.Request) -> float | None:
    """The seconds ``request`` may wait for a connection, read as httpcore reads it: its ``timeout`` extension's ``pool``."""
    timeouts = request.extensions.get("timeout")
    value = timeouts.get("pool") if isinstance(timeouts, Mapping) else None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def _limit(transport: object, transport_class: type[Any], pool_class: type[Any]) -> int | None:
    """The connection limit of ``transport``'s pool, or None: no limit, or one that cannot be read.

    Only a plain ``transport_class`` (not a subclass, not through a proxy)
    whose pool is a plain ``pool_class`` limited to ``max_connections``
    (``Limits(max_connections=None)``: no limit, no queue) with HTTP/2 off (an
    HTTP/2 connection carries many requests at once, so its pool's limit is
    not one on requests).
    """
    if type(transport) is not transport_class:
        return None
    pool = getattr(transport, "_pool", None)
    if type(pool) is not pool_class or getattr(pool, "_http2", True) is not False:
        return None
    limit = getattr(pool, "_max_connections", None)  # httpcore keeps None as sys.maxsize
    if type(limit) is not int or not 1 <= limit < sys.maxsize:
        return None
    return limit


def _timed_out(limit: int, seconds: float | None, request: httpx.Request) -> httpx.PoolTimeout:
    return httpx.PoolTimeout(f"no connection of the pool's {limit} came free within the pool timeout ({seconds} s)", request=request)


# ---- asyncio ----


def _expire(turn: asyncio.Future[bool]) -> None:
    """A waiter's pool timeout: its turn ends without a slot (unless a slot reached it first)."""
    if not turn.done():
        turn.set_result(False)


class DataQueue:
    """The queue of ``AsyncResilientTransport`` (the module docstring says why and its rules); one request let in per loop turn.

    A slot given back while requests wait is not handed on at once: it is
    counted (``_freed``) and ``_admit``, a loop callback, hands freed slots
    to the oldest waiters one per turn of the event loop, rescheduling itself
    (``loop.call_soon``) while freed slots and waiters remain. Streams of a
    batch submitted at once start together, get their events together and
    end together; handed on in the turn they ended, the next hundred requests
    would all be sent in one turn (httpx costs about 450 us of CPU a request:
    45 ms), and a control call's answer, ready meanwhile, would wait behind
    them. One per turn, the loop polls its sockets between two admissions, so
    a ready answer waits for one request's sending at most, and the starts
    (hence the events and ends) of the batch spread over as many turns. What
    this bounds is the admissions' share of a turn, not the whole turn: in
    ``benchmarks/bench_control_lane.py`` the slowest control calls beside
    1,000 streams mostly wait out garbage-collection pauses of the caller's
    process, which no queue shortens, and their p99 did not move clearly
    between one, 4 or 16 admissions per turn and none (BENCHMARKS.md).

    The cost: a waiter gets its slot one turn after the one before it, and
    one turn later than when the slot came free. On an idle loop a turn is
    microseconds (a poll that does not block and one callback), so admissions
    stay fast; on a busy loop each turn runs the admitted request's sending,
    which the turn would have run anyway, so the requests take the same CPU
    over more turns. A slot free while nobody waits is taken at once, as
    before: no callback, no turn.
    """

    def __init__(self, transport: httpx.AsyncBaseTransport, limit: int) -> None:
        self.transport = transport
        """The transport each request is sent through once it holds a slot."""
        self.limit = limit
        """Slots: the most requests inside ``transport`` at once."""
        self.inside = 0
        """Slots held now: requests being sent, responses not closed yet, and slots freed for waiters not handed on yet."""
        self._waiting: collections.deque[asyncio.Future[bool]] = collections.deque()
        """Each waiter's turn, oldest first: True once handed a slot, False on its pool timeout; a turn done before its
        slot came (timed out, cancelled) stays until ``_admit`` passes it."""
        self._freed = 0
        """Slots given back while requests waited, not handed on yet; above 0 exactly while ``_admit`` is scheduled."""
        self._slotless: BaseException | None = None
        """The error of the last wait that ended without a slot (``_after_wait``), until ``failed`` sees it."""

    @classmethod
    def of(cls, transport: httpx.AsyncBaseTransport) -> DataQueue | None:
        """The queue in front of ``transport``, or None: no limit to keep, or one that cannot be read.

        Only a plain ``httpx.AsyncHTTPTransport`` (not a subclass, not through
        a proxy) whose pool is a plain ``httpcore.AsyncConnectionPool``
        limited to ``max_connections``, HTTP/2 off (``_limit``).
        """
        limit = _limit(transport, httpx.AsyncHTTPTransport, httpcore.AsyncConnectionPool)
        return None if limit is None else cls(transport, limit)

    @property
    def waiting(self) -> int:
        """Requests waiting for a slot now."""
        return sum(not turn.done() for turn in self._waiting)

    async def send(self, request: httpx.Request) -> httpx.Response:
        """``transport.handle_async_request(request)`` once a slot is free; the response's stream holds the slot until closed.

        ``enter``, ``hold`` and ``failed`` together, for a caller that runs
        them in a frame of its own; ``AsyncResilientTransport`` runs them as
        the retry core's attempt, ``report`` and ``failed`` (no frame of ours
        on the request's await chain).
        """
        try:
            response = await self.enter(request)
        except BaseException as exc:
            self.failed(exc)
            raise
        return self.hold(response)

    def enter(self, request: httpx.Request) -> Awaitable[httpx.Response]:
        """Take a slot (or wait for one) and send ``request``: the transport's own awaitable when a slot is free.

        Its response goes to ``hold``, an error it raises to ``failed``, at
        once (no other task may run between the two: ``failed`` knows the
        error of a wait that ended without a slot by its identity).
        """
        if self.inside < self.limit:  # no one waits while a slot is free: a freed slot is kept for the oldest waiter
            self.inside += 1
            return self.transport.handle_async_request(request)
        return self._after_wait(request)

    async def _after_wait(self, request: httpx.Request) -> httpx.Response:
        try:
            await self._wait(request)
        except BaseException as exc:  # its pool timeout or a cancellation: no slot held (``_wait`` gave back one that came)
            self._slotless = exc
            raise
        return await self.transport.handle_async_request(request)

    def hold(self, response: httpx.Response) -> httpx.Response:
        """Let ``response`` hold its request's slot until it is closed, or a read of it fails; returns ``response``.

        A response of httpx's own pool (``AsyncResponseStream`` over
        httpcore's ``PoolByteStream``): that stream's ``aclose``, which
        httpcore also calls when a read fails, gives the slot back first
        (``_give_back``), so reading costs nothing more. Any other: the
        response's stream wrapped (``_SlotStream``).
        """
        stream: Any = response.stream
        if type(stream) is _RESPONSE_STREAM:
            core = stream._httpcore_stream
            if type(core) is _POOL_STREAM:
                core.aclose = functools.partial(_give_back, core, self)
                return response
        response.stream = _SlotStream(stream, self)
        return response

    def failed(self, exc: BaseException) -> None:
        """``exc`` ended ``enter``'s awaitable: its slot back, unless it ended a wait that held none."""
        if exc is self._slotless:
            self._slotless = None
            return
        self.leave()

    async def _wait(self, request: httpx.Request) -> None:
        """Wait for a slot; ``httpx.PoolTimeout`` after the request's pool timeout."""
        loop = asyncio.get_running_loop()
        turn: asyncio.Future[bool] = loop.create_future()
        self._waiting.append(turn)
        seconds = _pool_timeout(request)
        timer = None if seconds is None else loop.call_later(seconds, _expire, turn)
        try:
            entered = await turn
        except BaseException:  # cancelled
            handed = turn.done() and not turn.cancelled() and turn.result()
            turn.cancel()  # still pending (an error other than a cancellation): ``_admit`` passes it from now on
            if handed:  # a slot reached the turn just before the cancellation: the next waiter takes it
                self.leave()
            raise
        finally:
            if timer is not None:
                timer.cancel()
        if not entered:
            raise _timed_out(self.limit, seconds, request)

    def leave(self) -> None:
        """Give a slot back: kept for the requests waiting (``_admit`` hands it on next turn), or to the pool's free ones."""
        if self._waiting:
            self._freed += 1
            if self._freed == 1:  # none scheduled yet
                loop = asyncio.get_running_loop()
                loop.call_soon(self._admit, loop)
            return
        self.inside -= 1

    def _admit(self, loop: asyncio.AbstractEventLoop) -> None:
        """Hand one freed slot to the oldest request still waiting; again next turn while freed slots and waiters remain.

        Freed slots that find no one waiting (the waiters timed out or were
        cancelled meanwhile) go back to the pool's free ones.
        """
        waiting = self._waiting
        while waiting:
            turn = waiting.popleft()
            if not turn.done():
                turn.set_result(True)
                self._freed -= 1
                break
        if self._freed and waiting:
            loop.call_soon(self._admit, loop)
            return
        self.inside -= self._freed
        self._freed = 0


async def _give_back(core: Any, queue: DataQueue) -> None:
    """httpcore's ``PoolByteStream.aclose`` for a stream that holds a ``DataQueue`` slot: the close, then the slot back, once.

    Installed on the stream by ``DataQueue.hold``; the first close removes it,
    so later ones are httpcore's own (which does nothing twice).
    """
    try:
        del core.aclose
    except AttributeError:  # a second close begun before the first ran (httpx and httpcore await each at once)
        await core.aclose()
        return
    try:
        await core.aclose()
    finally:
        queue.leave()


def _own_streams(flavour: str, response: str) -> tuple[type[Any] | None, type[Any] | None]:
    """(httpx's ``response`` stream class, httpcore's ``PoolByteStream`` of ``flavour``, "async" or "sync"): the streams
    of an ``AsyncHTTPTransport`` or ``HTTPTransport`` response.

    Private classes, so checked: (None, None) where the modules differ from
    httpx 0.28-0.29 and httpcore 1.0, or where httpcore's stream takes no
    attribute of its own; then every response gets a ``_SlotStream`` or ``_SyncSlotStream``.
    """
    try:
        core = importlib.import_module(f"httpcore._{flavour}.connection_pool").PoolByteStream
        outer = getattr(importlib.import_module("httpx._transports.default"), response)
    except (ImportError, AttributeError):
        return None, None
    return (outer, core) if "__slots__" not in vars(core) else (None, None)


_RESPONSE_STREAM, _POOL_STREAM = _own_streams("async", "AsyncResponseStream")
_SYNC_RESPONSE_STREAM, _SYNC_POOL_STREAM = _own_streams("sync", "ResponseStream")


class _SlotStream(httpx.AsyncByteStream):
    """A response's stream that gives its request's ``DataQueue`` slot back once: when it is closed, or reading it fails.

    For a response whose stream is not httpcore's own (``DataQueue.hold``): another transport's, a mock's.
    """

    def __init__(self, stream: httpx.AsyncByteStream, queue: DataQueue) -> None:
        self._stream = stream
        self._queue: DataQueue | None = queue

    async def __aiter__(self) -> AsyncIterator[bytes]:
        try:
            async for part in self._stream:
                yield part
        except BaseException:  # a read that failed or was abandoned closes the stream, as httpcore's own does
            await self.aclose()
            raise

    async def aclose(self) -> None:
        try:
            await self._stream.aclose()
        finally:
            queue, self._queue = self._queue, None
            if queue is not None:
                queue.leave()


# ---- threads ----


class _Waiter:
    """One thread waiting in a ``SyncDataQueue``: a gate it blocks on, opened when a slot is handed to it."""

    __slots__ = ("gate", "handed")

    def __init__(self) -> None:
        self.gate = threading.Lock()
        """Held from the start; ``SyncDataQueue.leave`` releases it, with the slot."""
        self.gate.acquire()
        self.handed: bool | None = None
        """None: waiting; True: handed a slot; False: gone (its pool timeout passed, or its thread was interrupted)."""


class SyncDataQueue:
    """The queue of ``ResilientTransport`` (the module docstring says why and its rules): threads wait here, one gate each.

    A slot given back is handed to the oldest thread still waiting at once
    (its gate opened): threads take turns at the GIL anyway, so there is no
    loop turn to spread them over. One lock guards the count and the queue;
    a request that finds a slot free takes it under that lock and never
    blocks.
    """

    def __init__(self, transport: httpx.BaseTransport, limit: int) -> None:
        self.transport = transport
        """The transport each request is sent through once it holds a slot."""
        self.limit = limit
        """Slots: the most requests inside ``transport`` at once."""
        self.inside = 0
        """Slots held now: requests being sent, and responses not closed yet."""
        self._lock = threading.Lock()
        """Guards ``inside``, ``_waiting`` and each waiter's ``handed``."""
        self._waiting: collections.deque[_Waiter] = collections.deque()
        """The threads waiting, oldest first; one gone (timed out, interrupted) stays until ``leave`` passes it."""

    @classmethod
    def of(cls, transport: httpx.BaseTransport) -> SyncDataQueue | None:
        """``DataQueue.of`` for a sync transport: a plain ``httpx.HTTPTransport`` over a plain ``httpcore.ConnectionPool``."""
        limit = _limit(transport, httpx.HTTPTransport, httpcore.ConnectionPool)
        return None if limit is None else cls(transport, limit)

    @property
    def waiting(self) -> int:
        """Requests waiting for a slot now."""
        with self._lock:
            return sum(waiter.handed is None for waiter in self._waiting)

    def send(self, request: httpx.Request) -> httpx.Response:
        """``transport.handle_request(request)`` once a slot is free; the response's stream holds the slot until closed."""
        waiter = None
        with self._lock:
            if self.inside < self.limit:  # no one waits while a slot is free: a freed slot goes to the oldest waiter
                self.inside += 1
            else:
                waiter = _Waiter()
                self._waiting.append(waiter)
        if waiter is not None:
            self._wait(waiter, request)
        try:
            response = self.transport.handle_request(request)
        except BaseException:
            self.leave()
            raise
        return self.hold(response)

    def hold(self, response: httpx.Response) -> httpx.Response:
        """``DataQueue.hold`` for threads: httpcore's own ``PoolByteStream.close`` gives the slot back (``_sync_give_back``),
        else a ``_SyncSlotStream``."""
        stream: Any = response.stream
        if type(stream) is _SYNC_RESPONSE_STREAM:
            core = stream._httpcore_stream
            if type(core) is _SYNC_POOL_STREAM:
                core.close = functools.partial(_sync_give_back, core, self)
                return response
        response.stream = _SyncSlotStream(stream, self)
        return response

    def _wait(self, waiter: _Waiter, request: httpx.Request) -> None:
        """Block until a slot is handed to ``waiter``; ``httpx.PoolTimeout`` after the request's pool timeout."""
        seconds = _pool_timeout(request)
        try:
            if waiter.gate.acquire(timeout=-1 if seconds is None else seconds):
                return
        except BaseException:  # interrupted (KeyboardInterrupt in the main thread)
            if self._give_up(waiter):  # a slot reached it just before: the next waiter takes it
                self.leave()
            raise
        if not self._give_up(waiter):
            raise _timed_out(self.limit, seconds, request)
        # a slot reached it between the timeout and the lock: it is in

    def _give_up(self, waiter: _Waiter) -> bool:
        """Mark ``waiter`` gone unless a slot already reached it; whether one did."""
        with self._lock:
            if waiter.handed:
                return True
            waiter.handed = False
            return False

    def leave(self) -> None:
        """Give a slot back: to the oldest thread still waiting (its gate opened), or to the pool's free ones."""
        with self._lock:
            waiting = self._waiting
            while waiting:
                waiter = waiting.popleft()
                if waiter.handed is None:
                    waiter.handed = True
                    waiter.gate.release()
                    return
            self.inside -= 1


def _sync_give_back(core: Any, queue: SyncDataQueue) -> None:
    """``_give_back`` for a ``SyncDataQueue``: httpcore's ``PoolByteStream.close``, then the slot back, once (the
    ``del`` of the first close, atomic under the GIL, makes a second one, in any thread, httpcore's own)."""
    try:
        del core.close
    except AttributeError:
        core.close()
        return
    try:
        core.close()
    finally:
        queue.leave()


class _SyncSlotStream(httpx.SyncByteStream):
    """``_SlotStream`` for a ``SyncDataQueue``: gives the slot back once, when closed or when reading fails."""

    def __init__(self, stream: httpx.SyncByteStream, queue: SyncDataQueue) -> None:
        self._stream = stream
        self._queue = queue
        """Removed by the first close (``dict.pop``: atomic under the GIL, so two threads closing at once give it back once)."""

    def __iter__(self) -> Iterator[bytes]:
        try:
            yield from self._stream
        except BaseException:  # a read that failed or was abandoned closes the stream, as httpcore's own does
            self.close()
            raise

    def close(self) -> None:
        try:
            self._stream.close()
        finally:
            queue: SyncDataQueue | None = self.__dict__.pop("_queue", None)
            if queue is not None:
                queue.leave()
