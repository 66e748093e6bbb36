"""Reading ahead a stream its reader has left, so its call settles exactly and its hold frees room for waiters.

The commonest way to abandon a stream keeps it referenced: ``for n, chunk in enumerate(stream): if n == 2:
break`` closes the SDK's ``__iter__`` generator, but its inner iterator, the HTTP response and the guard's
tee stay open until ``stream`` is collected, and so does the call's hold. When a guarded call starts
while such a stream is open and not inside a read, the guard pulls the rest of its body through the same
tee (the SSE usage reader sees every byte; the call settles from the final usage chunk, exactly), into a
buffer the consumer reads first if it ever resumes: a wrong guess that the stream was left costs only
the buffer, and the consumer gets the identical bytes.

Triggers (the connection is open in each: reading costs the provider nothing it was not generating):

1. a guarded call from the thread (sync) or asyncio task (async) that opened the stream
   (:func:`leave_mine`): that thread or task cannot be inside a read of it, it is here;
2. a call that must wait for room (:func:`leave_all`): every open stream of the process not inside a
   read, whatever thread opened it, as their holds may be what it waits for.

A stream the program closed, or that was collected, is never read ahead: it is charged its whole hold
as before (draining a closed connection could make a provider that stops on disconnect bill more).
A read-ahead already under way when the stream is closed or collected goes on to the end: the connection
was being drained already (openai closes the response when the cyclic collector takes a dropped stream).

Bounds: a read-ahead stops after :data:`MAX_SECONDS` or :data:`MAX_BYTES` buffered, whichever first; the
stream then stays as it was (settled when closed or collected, at its whole hold) and is not read ahead
again. The consumer and a read-ahead never read the upstream at once (a per-stream lock); a consumer that
resumes ends the read-ahead and takes the buffered bytes first. Sync streams are read ahead on a daemon
thread each; async streams by a task on the stream's own event loop (a loop is never blocked). At
interpreter exit no read-ahead starts, and one still running leaves its hold to the wrapper (charged whole).
"""

from __future__ import annotations

import atexit
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import AsyncIterator, Iterable, Iterator
from typing import Any, Protocol

__all__ = ["MAX_BYTES", "MAX_SECONDS", "AsyncStream", "SyncStream", "leave_all", "leave_mine", "mine_pending"]

# The openai SDK's own request timeout and --wait's default: a caller waiting for this room would give up
# by then anyway. 16 MiB is some 100 times the longest answer a model streams (SSE frames of 64k tokens).
MAX_SECONDS = 600.0
MAX_BYTES = 16 * 1024 * 1024


class Teed(Protocol):
    """What a read-ahead needs of the guarded call (a :class:`~quotawrap.settling.call.GuardedCall`)."""

    def tee(self, chunks: Iterable[bytes]) -> Iterator[bytes]: ...

    def atee(self, chunks: Any) -> AsyncIterator[bytes]: ...

    def close(self) -> None: ...

    def flush(self) -> None: ...


# The open streams, weakly: a stream leaves when it is collected. Nothing a collection runs (a consumer's
# generator closing) takes the lock, so a collection inside it cannot deadlock.
_open: weakref.WeakSet[_Stream] = weakref.WeakSet()
_open_lock = threading.Lock()  # a WeakSet may not change while another thread iterates it
_exiting = False


class _Stream:
    """The state a consumer and a read-ahead share; subclasses hold the lock and the upstream."""

    def __init__(self) -> None:
        self._buffer: deque[bytes] = deque()
        self._size = 0
        self._error: BaseException | None = None
        self._ended = False  # the upstream has nothing more (its end, or an error)
        self._closed = False  # the program closed the stream, or it was collected: never read ahead
        self._dropped = False  # collected while a read-ahead ran: it goes on, then releases the upstream
        self._reading = False  # the consumer is inside a read (one consumer at a time: its generator)
        self._running = False  # a read-ahead was asked for and has not finished (its settle not yet landed)
        self._spent = False  # a read-ahead hit a bound: the stream is left as it is
        with _open_lock:
            _open.add(self)

    _call: Teed

    def _left_for_good(self) -> None:
        """The consumer's generator closed or was collected: a running read-ahead goes on to the end and
        releases the upstream; otherwise, as before read-ahead, the hold is charged whole and the upstream
        goes with its last reference (no close here: a collection may run on any thread, inside the HTTP
        pool's own lock)."""
        if self._running:
            self._dropped = True
            return
        self._closed = True
        self._call.close()

    def _leavable(self) -> bool:
        busy = self._reading or self._closed or self._ended or self._running or self._spent
        return not (busy or _exiting or sys.is_finalizing())

    def _forget(self) -> None:
        """Read to its end: no trigger needs to look at it again (never called from a collection)."""
        with _open_lock:
            _open.discard(self)

    def _take(self) -> bytes:
        chunk = self._buffer.popleft()
        self._size -= len(chunk)
        return chunk

    def _keep(self, chunk: bytes) -> None:
        if chunk:
            self._buffer.append(chunk)
            self._size += len(chunk)

    def _goes_on(self, deadline: float) -> bool:
        if self._size >= MAX_BYTES or time.monotonic() >= deadline:
            self._spent = True
            return False
        # A stream closed while it is read ahead (openai closes the response when the cyclic collector takes
        # its stream) is read on to its end: the connection was being drained already, and the end gives the
        # exact charge instead of the whole hold.
        return not (self._reading or self._ended)

    def mine(self, thread: int, task: object) -> bool:
        raise NotImplementedError

    def read_ahead(self) -> None:
        raise NotImplementedError


class SyncStream(_Stream):
    """A sync body (an iterable of bytes with ``close()``) teed through ``call``, that can be read ahead."""

    def __init__(self, inner: Any, call: Teed) -> None:
        self._inner = inner
        self._call = call
        self._source = call.tee(inner)
        self._lock = threading.Lock()
        self._owner = threading.get_ident()
        super().__init__()

    def mine(self, thread: int, task: object) -> bool:
        return self._owner == thread

    def chunks(self) -> Iterator[bytes]:
        """The consumer's read: buffered bytes first, then the upstream."""
        source = self._source
        try:
            while True:
                self._reading = True  # before it looks at ``_running``: a read-ahead started after sees it
                try:
                    if self._running or self._buffer or self._ended or self._error is not None:
                        chunk = self._locked_next()
                    else:
                        # Nothing read ahead and none running: no lock (a read-ahead starting now sees
                        # ``_reading`` before it pulls, and stops). Most chunks of every stream pass here.
                        chunk = next(source, None)
                        if chunk is None:
                            self._ended = True
                except BaseException:  # the upstream failed (the tee settled it), or its error is handed on
                    self._ended = True
                    raise
                finally:
                    self._reading = False
                if chunk is None:
                    self._forget()
                    return
                yield chunk
        except GeneratorExit:  # the consumer's generator closed or collected
            self._left_for_good()
            raise

    def _locked_next(self) -> bytes | None:
        """The next chunk (None at the end): the buffer's first, else the upstream's, the lock held."""
        with self._lock:
            if self._buffer:
                return self._take()
            if self._error is not None:
                error, self._error = self._error, None
                raise error
            if self._ended:
                return None
            chunk = self._pull()
            return None if self._ended else chunk

    def _pull(self) -> bytes:
        """One chunk from the upstream (the lock held); at its end or error, ``_ended``."""
        try:
            return next(self._source)
        except StopIteration:
            self._ended = True
            return b""
        except BaseException:
            self._ended = True
            raise

    def read_ahead(self) -> None:
        with _open_lock:  # two triggers at once start one read-ahead
            if not self._leavable():
                return
            self._running = True
        try:
            threading.Thread(target=self._run, name="quotawrap-readahead", daemon=True).start()
        except RuntimeError:  # no new thread at interpreter exit
            self._running = False

    def _run(self) -> None:
        deadline = time.monotonic() + MAX_SECONDS
        try:
            while self._goes_on(deadline):
                with self._lock:
                    if self._reading or self._ended:
                        break
                    try:
                        self._keep(self._pull())
                    except BaseException as exc:  # the tee settled it; the consumer gets it after the buffer
                        self._error = exc
            if self._ended:
                self._call.flush()  # the settle has landed: a call waiting for this room sees it
        finally:
            try:
                if self._closed or self._dropped:
                    self._close_upstream()
            finally:
                self._running = False  # after the settle is handed on: a waiter never sees neither

    def close(self) -> None:
        """The program closed the stream: close the upstream now, or after the read-ahead's current read."""
        self._closed = True
        self._buffer.clear()
        if self._lock.acquire(blocking=False):
            try:
                self._close_upstream()
            finally:
                self._lock.release()

    def _close_upstream(self) -> None:
        try:
            self._inner.close()
        finally:
            self._call.close()


class AsyncStream(_Stream):
    """An async body (an async iterable of bytes with ``aclose()``) teed through ``call``, on its loop."""

    def __init__(self, inner: Any, call: Teed) -> None:
        import asyncio

        self._inner = inner
        self._call = call
        self._source = call.atee(inner)
        self._lock = asyncio.Lock()
        self._loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        self._owner: weakref.ref[Any] | None = weakref.ref(task) if task is not None else None
        self._task: Any = None
        super().__init__()

    def mine(self, thread: int, task: object) -> bool:
        return task is not None and self._owner is not None and self._owner() is task

    async def chunks(self) -> AsyncIterator[bytes]:
        source = self._source
        try:
            while True:
                self._reading = True
                try:
                    if self._running or self._buffer or self._ended or self._error is not None:
                        chunk = await self._locked_next()
                    else:  # as the sync read: no lock while no read-ahead runs (one spawned now sees ``_reading``)
                        try:
                            chunk = await source.__anext__()
                        except StopAsyncIteration:
                            chunk = None
                            self._ended = True
                except BaseException:
                    self._ended = True
                    raise
                finally:
                    self._reading = False
                if chunk is None:
                    self._forget()
                    return
                yield chunk
        except GeneratorExit:
            self._left_for_good()
            raise

    async def _locked_next(self) -> bytes | None:
        async with self._lock:
            if self._buffer:
                return self._take()
            if self._error is not None:
                error, self._error = self._error, None
                raise error
            if self._ended:
                return None
            chunk = await self._pull()
            return None if self._ended else chunk

    async def _pull(self) -> bytes:
        try:
            return await self._source.__anext__()
        except StopAsyncIteration:
            self._ended = True
            return b""
        except BaseException:
            self._ended = True
            raise

    def read_ahead(self) -> None:
        with _open_lock:
            if not self._leavable():
                return
            self._running = True
        try:
            self._loop.call_soon_threadsafe(self._spawn)
        except RuntimeError:  # the loop is closed
            self._running = False

    def _spawn(self) -> None:
        if self._closed or self._ended or self._reading:
            self._running = False
            return
        self._task = self._loop.create_task(self._run())

    async def _run(self) -> None:
        deadline = time.monotonic() + MAX_SECONDS
        try:
            while self._goes_on(deadline):
                async with self._lock:
                    if self._reading or self._closed or self._ended:
                        break
                    try:
                        self._keep(await self._pull())
                    except Exception as exc:
                        self._error = exc
            if self._ended:
                await self._loop.run_in_executor(None, self._call.flush)  # a ledger write: off the loop
        finally:
            self._running = False
            self._task = None

    async def aclose(self) -> None:
        """The program closed the stream: end a read-ahead at once (its call charged whole), close."""
        self._closed = True
        self._buffer.clear()
        task = self._task
        if task is not None and not task.done():
            task.cancel()
            import asyncio

            await asyncio.wait({task})  # its end, whatever it was (the tee settled it); our own cancel propagates
            self._running = False  # a task cancelled before it started never ran its own ``finally``
        try:
            await self._inner.aclose()
        finally:
            self._call.close()


def _current_task() -> object:
    asyncio = sys.modules.get("asyncio")
    if asyncio is None:
        return None
    try:
        return asyncio.current_task()
    except RuntimeError:  # no running loop in this thread
        return None


def _streams() -> list[_Stream]:
    with _open_lock:
        return list(_open)


def leave_mine() -> None:
    """Trigger 1: a guarded call starts; read ahead the open streams its thread or task opened and left."""
    if not _open:
        return
    thread, task = threading.get_ident(), _current_task()
    for stream in _streams():
        if stream.mine(thread, task):
            stream.read_ahead()


def leave_all() -> bool:
    """Trigger 2: a call must wait for room; read ahead every open stream of the process not inside a read.
    True when some read-ahead of the process is running (its settle may make the room)."""
    if not _open:
        return False
    for stream in _streams():
        stream.read_ahead()
    return any_pending()


def any_pending() -> bool:
    """True while some stream of the process is being read ahead."""
    return bool(_open) and any(stream._running for stream in _streams())


def mine_pending() -> bool:
    """True while a stream this thread or task left is being read ahead (its settle may make room)."""
    if not _open:
        return False
    thread, task = threading.get_ident(), _current_task()
    return any(stream._running and stream.mine(thread, task) for stream in _streams())


def _at_exit() -> None:
    global _exiting
    _exiting = True


atexit.register(_at_exit)
