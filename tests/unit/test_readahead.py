"""Tests for quotawrap.settling.readahead: the buffer, the lock and the triggers, on a fake upstream and call.

The interception around it (httpx, the openai SDK, the simulator) is covered end to end by
tests/integration/test_abandoned_streams.py; here each rule is pinned on its own.
"""

from __future__ import annotations

import asyncio
import gc
import threading
from collections.abc import AsyncIterator, Iterable, Iterator
from typing import Any

import pytest

from quotawrap.settling import readahead
from quotawrap.settling.readahead import AsyncStream, SyncStream

BODY = [b"data: %d\n\n" % n for n in range(8)]
SAFETY_S = 30  # how long a test waits for a read-ahead before it fails (never a figure the test checks)


class FakeCall:
    """What the guard's call does for a read-ahead: a tee that notes what passed, a settle that notes how."""

    def __init__(self) -> None:
        self.seen: list[bytes] = []
        self.finished = threading.Event()
        self.closed = False
        self.failed: BaseException | None = None

    def tee(self, chunks: Iterable[bytes]) -> Iterator[bytes]:
        try:
            for chunk in chunks:
                self.seen.append(chunk)
                yield chunk
        except GeneratorExit:
            self.closed = True
            raise
        except BaseException as exc:
            self.failed = exc
            raise
        self.finished.set()

    async def atee(self, chunks: Any) -> AsyncIterator[bytes]:
        async for chunk in chunks:
            self.seen.append(chunk)
            yield chunk
        self.finished.set()

    def close(self) -> None:
        self.closed = True

    def flush(self) -> None:
        pass


class Upstream:
    """A body that can fail after ``fail_after`` chunks, or block before a chunk until released."""

    def __init__(self, chunks: list[bytes], *, fail_after: int | None = None, block_at: int | None = None) -> None:
        self._chunks = chunks
        self._fail_after = fail_after
        self._block_at = block_at
        self.release = threading.Event()
        self.blocked = threading.Event()
        self.closed = False

    def __iter__(self) -> Iterator[bytes]:
        for n, chunk in enumerate(self._chunks):
            if n == self._fail_after:
                raise ConnectionError("reset")
            if n == self._block_at:
                self.blocked.set()
                self.release.wait(SAFETY_S)
            yield chunk

    def close(self) -> None:
        self.closed = True


def _left(upstream: Upstream, read: int = 3) -> tuple[SyncStream, FakeCall, Iterator[bytes], list[bytes]]:
    """A stream its consumer read ``read`` chunks of and then left (its generator suspended, still referenced)."""
    call = FakeCall()
    stream = SyncStream(upstream, call)
    chunks = stream.chunks()
    got = [next(chunks) for _ in range(read)]
    return stream, call, chunks, got


def _idle(stream: Any) -> None:
    """Wait (bounded by a safety timeout, not measured) until no read-ahead of ``stream`` runs."""
    done = threading.Event()

    def watch() -> None:
        while stream._running:
            threading.Event().wait(0.001)
        done.set()

    threading.Thread(target=watch, daemon=True).start()
    assert done.wait(SAFETY_S)


class TestSyncReadAhead:
    def test_the_same_thread_reads_ahead_and_a_resumed_consumer_gets_the_identical_bytes(self) -> None:
        """A new call from the thread that left it drains the rest through the tee (the call settles from
        its end); a consumer that resumes reads the buffer, unchanged and in order."""
        stream, call, chunks, got = _left(Upstream(BODY))
        readahead.leave_mine()
        assert call.finished.wait(SAFETY_S)
        _idle(stream)
        assert call.seen == BODY and not call.closed
        assert got + list(chunks) == BODY

    def test_another_thread_reads_ahead_only_when_it_waits(self) -> None:
        """A call from another thread leaves it alone (its reader may be that thread); a call that must
        wait for room reads ahead every stream not inside a read."""
        stream, call, chunks, _ = _left(Upstream(BODY))
        other = threading.Thread(target=readahead.leave_mine)
        other.start()
        other.join()
        assert not stream._running and call.seen == BODY[:3]
        waiter = threading.Thread(target=readahead.leave_all)
        waiter.start()
        waiter.join()
        assert call.finished.wait(SAFETY_S)
        _idle(stream)
        assert list(chunks) == BODY[3:]

    def test_a_closed_stream_is_never_read_ahead(self) -> None:
        """The program closed it: upstream closed, call charged whole (its close), nothing more read."""
        upstream = Upstream(BODY)
        stream, call, _, _ = _left(upstream)
        stream.close()
        readahead.leave_all()
        assert not stream._running
        assert upstream.closed and call.closed and call.seen == BODY[:3]

    def test_a_collected_stream_is_charged_whole_not_read_ahead(self) -> None:
        """Collected before any trigger: as before read-ahead, the call is closed (whole hold)."""
        stream, call, chunks, _ = _left(Upstream(BODY))
        del stream, chunks
        gc.collect()
        readahead.leave_all()
        assert call.closed and call.seen == BODY[:3]

    def test_a_stream_inside_a_read_is_not_read_ahead(self) -> None:
        """Its consumer waits on the upstream in another thread: it is not left, whatever waits for room."""
        upstream = Upstream(BODY, block_at=3)
        stream, _call, chunks, got = _left(upstream)
        rest: list[bytes] = []
        reader = threading.Thread(target=lambda: rest.extend(chunks))
        reader.start()
        assert upstream.blocked.wait(SAFETY_S)
        readahead.leave_all()
        assert not stream._running
        upstream.release.set()
        reader.join(SAFETY_S)
        assert got + rest == BODY

    def test_a_bound_stops_the_read_ahead_and_leaves_the_stream_as_it_was(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Past the byte bound it stops (the call not settled), is not read ahead again, and the consumer
        still gets every byte: the buffer first, then the upstream."""
        monkeypatch.setattr(readahead, "MAX_BYTES", len(BODY[0]) * 2)
        stream, call, chunks, got = _left(Upstream(BODY))
        readahead.leave_mine()
        _idle(stream)
        assert stream._spent and not call.finished.is_set()
        readahead.leave_mine()
        assert not stream._running
        assert got + list(chunks) == BODY and call.finished.is_set()

    def test_an_upstream_error_reaches_the_consumer_after_the_buffer(self) -> None:
        """The read-ahead meets the error (the tee settles it as failed); the consumer gets what was read, then it."""
        stream, call, chunks, _got = _left(Upstream(BODY, fail_after=5))
        readahead.leave_mine()
        _idle(stream)
        assert isinstance(call.failed, ConnectionError)
        assert next(chunks) == BODY[3] and next(chunks) == BODY[4]
        with pytest.raises(ConnectionError):
            next(chunks)

    def test_a_close_during_a_read_ahead_lets_it_reach_the_end(self) -> None:
        """openai closes the response when the cyclic collector takes a stream dropped with ``del``: a read-ahead
        that runs then goes on to the end (the exact charge, not the whole hold), then closes the upstream."""
        upstream = Upstream(BODY, block_at=5)
        stream, call, _chunks, _ = _left(upstream)
        readahead.leave_mine()
        assert upstream.blocked.wait(SAFETY_S)
        stream.close()  # the read-ahead holds the lock: the close is left to it
        assert not upstream.closed
        upstream.release.set()
        assert call.finished.wait(SAFETY_S)
        _idle(stream)
        assert call.seen == BODY and upstream.closed

    def test_mine_pending_while_a_read_ahead_of_this_thread_runs(self) -> None:
        """The reserve loop waits on its own left streams while they are read ahead (their settle frees room)."""
        upstream = Upstream(BODY, block_at=5)
        stream, call, chunks, _ = _left(upstream)
        readahead.leave_mine()
        assert upstream.blocked.wait(SAFETY_S)
        assert readahead.mine_pending()
        upstream.release.set()
        _idle(stream)
        assert not readahead.mine_pending() and call.finished.is_set()
        assert list(chunks) == BODY[3:]


class AsyncUpstream:
    def __init__(self, chunks: list[bytes]) -> None:
        self._chunks = chunks
        self.closed = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for chunk in self._chunks:
            await asyncio.sleep(0)
            yield chunk

    async def aclose(self) -> None:
        self.closed = True


class TestAsyncReadAhead:
    def test_the_same_task_reads_ahead_on_its_loop_and_a_resumed_consumer_gets_the_identical_bytes(self) -> None:
        async def scenario() -> tuple[list[bytes], FakeCall]:
            call = FakeCall()
            stream = AsyncStream(AsyncUpstream(BODY), call)
            chunks = stream.chunks()
            got = [await chunks.__anext__() for _ in range(3)]
            readahead.leave_mine()  # as the task's next guarded call does
            while stream._running:
                await asyncio.sleep(0.001)
            assert call.finished.is_set() and not call.closed
            got.extend([chunk async for chunk in chunks])
            return got, call

        got, call = asyncio.run(scenario())
        assert got == BODY and call.seen == BODY

    def test_aclose_ends_a_running_read_ahead_and_charges_whole(self) -> None:
        async def scenario() -> tuple[AsyncUpstream, FakeCall]:
            call = FakeCall()
            upstream = AsyncUpstream(BODY * 1000)
            stream = AsyncStream(upstream, call)
            chunks = stream.chunks()
            await chunks.__anext__()
            readahead.leave_all()
            await asyncio.sleep(0)
            await stream.aclose()
            assert not stream._running
            return upstream, call

        upstream, call = asyncio.run(scenario())
        assert upstream.closed and call.closed and not call.finished.is_set()
