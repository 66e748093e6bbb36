"""httpx and httpx2 (same API): wrap ``Client._send_single_request`` and its async twin.

That private method is the one place every request passes whatever the transport (default,
mounted, MockTransport, aiohttp): patching ``HTTPTransport.handle_request`` alone would miss
custom transports. It returns the response before its body is read, so one byte-stream tee
sees streamed and non-streamed bodies alike. ``HTTPTransport.handle_request`` (and its async
twin) are wrapped too, for programs that drive a transport directly; the context mark of
:mod:`._scope` makes the transport seam stand aside when the client seam already guards.
"""

from __future__ import annotations

import datetime
import functools
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from types import ModuleType
from typing import Any, cast

from . import _scope

TYPE_CHECKING = False
if TYPE_CHECKING:  # the guard (and its imports) load on the first guarded call, not with the client
    from ..settling.call import GuardedCall

__all__ = ["patch", "unpatch"]

_MARK = "_quotawrap_patched"


def _not_sent_errors(module: ModuleType) -> tuple[type[BaseException], ...]:
    return tuple(
        getattr(module, name)
        for name in ("ConnectError", "ConnectTimeout", "PoolTimeout", "UnsupportedProtocol")
        if hasattr(module, name)
    )


def _synthetic(module: ModuleType, call: GuardedCall, request: Any) -> Any:
    assert call.blocked is not None
    response = module.Response(
        call.blocked.status, headers=list(call.blocked.headers), content=call.blocked.body, request=request
    )
    response.elapsed = datetime.timedelta(0)
    return response


def _prepared(module: ModuleType, request: Any, call: GuardedCall) -> Any:
    """The request as it goes out: identity encoding, and the usage-asking body if any."""
    if call.new_body is None:
        for name, value in call.HEADER_OVERRIDES.items():
            request.headers[name] = value
        return request
    fields = vars(request)
    byte_stream = getattr(module, "ByteStream", None)
    if byte_stream is None or not fields.keys() >= _REQUEST_FIELDS:  # a Request we do not know: build one
        headers = request.headers.copy()
        headers.pop("content-length", None)
        for name, value in call.HEADER_OVERRIDES.items():
            headers[name] = value
        return module.Request(
            request.method, request.url, headers=headers, content=call.new_body, extensions=request.extensions
        )
    # A copy of the caller's request with the new body: the caller's own is left as it was, and building
    # a Request anew would encode URL, headers and body again, on every guarded call.
    headers = body_headers(request.headers, call.HEADER_OVERRIDES, len(call.new_body))
    prepared = object.__new__(type(request))
    vars(prepared).update(fields, headers=headers, stream=byte_stream(call.new_body), _content=call.new_body)
    return prepared


def body_headers(headers: Any, overrides: Mapping[str, str], length: int) -> Any:
    """A copy of ``headers`` for a new body of ``length`` bytes: no transfer-encoding, its content-length,
    and ``overrides`` set.

    httpx keeps headers as a list of (name, lowercased name, value) entries, and each ``pop`` or set
    through the mapping scans all of them: edited as that list in one pass, once instead of per header,
    on every guarded call whose body changes. Headers of another shape are edited through the mapping.
    """
    copy = headers.copy()
    entries = _entries(copy)
    if entries is not None:
        added = [(name.encode(), name.lower().encode(), value.encode()) for name, value in overrides.items()]
        added.append((b"content-length", b"content-length", str(length).encode()))
        dropped = {entry[1] for entry in added} | {b"transfer-encoding"}
        copy._list = [entry for entry in entries if entry[1] not in dropped] + added
        return copy
    copy.pop("content-length", None)
    copy.pop("transfer-encoding", None)
    for name, value in overrides.items():
        copy[name] = value
    copy["content-length"] = str(length)
    return copy


# What GuardedCall.response_started reads of an answer's headers (lowercased, as httpx keeps them too).
_READ_HEADERS = {name.encode(): name for name in ("content-encoding", "content-type", "location")}


def read_headers(headers: Any) -> Mapping[str, str]:
    """The answer's headers that ``GuardedCall.response_started`` reads, as a dict by lowercased name.

    Each lookup in httpx's headers scans all of them (a list of (name, lowercased name, value) entries) and
    decodes what matches: gathered here in one pass, values decoded and repeated ones joined as httpx's
    lookup does. Headers of another shape are handed on as they are.
    """
    entries = _entries(headers)
    if entries is None:
        return cast(Mapping[str, str], headers)
    encoding = headers.encoding
    found: dict[str, str] = {}
    for entry in entries:
        name = _READ_HEADERS.get(entry[1])
        if name is not None:
            value = entry[2].decode(encoding)
            found[name] = f"{found[name]}, {value}" if name in found else value
    return found


def _entries(headers: Any) -> list[tuple[bytes, bytes, bytes]] | None:
    """httpx's headers as its list of (name, lowercased name, value) entries; None for headers of another shape."""
    entries = getattr(headers, "_list", None)
    if type(entries) is list and (not entries or (type(entries[0]) is tuple and len(entries[0]) == 3)):
        return entries
    return None


_REQUEST_FIELDS = frozenset({"method", "url", "headers", "extensions", "stream", "_content"})


def _tee_classes(module: ModuleType) -> tuple[type, type]:
    from ..settling import readahead

    class TeeSyncStream(module.SyncByteStream):  # type: ignore[misc,name-defined]
        def __init__(self, inner: Any, call: GuardedCall) -> None:
            self._inner = inner
            self._call = call
            # An event stream a program may leave unread while it holds on to it: it can be read ahead.
            self._ahead = readahead.SyncStream(inner, call) if call.streaming else None

        def __iter__(self) -> Iterator[bytes]:
            if self._ahead is not None:
                return self._ahead.chunks()
            return self._call.tee(self._inner)

        def close(self) -> None:
            if self._ahead is not None:
                self._ahead.close()
                return
            try:
                self._inner.close()
            finally:
                self._call.close()

    class TeeAsyncStream(module.AsyncByteStream):  # type: ignore[misc,name-defined]
        def __init__(self, inner: Any, call: GuardedCall) -> None:
            self._inner = inner
            self._call = call
            self._ahead = readahead.AsyncStream(inner, call) if call.streaming else None

        def __aiter__(self) -> AsyncIterator[bytes]:
            if self._ahead is not None:
                return self._ahead.chunks()
            return self._call.atee(self._inner)

        async def aclose(self) -> None:
            if self._ahead is not None:
                await self._ahead.aclose()
                return
            try:
                await self._inner.aclose()
            finally:
                self._call.close()

    return TeeSyncStream, TeeAsyncStream


def _observe(response: Any, call: GuardedCall, tee: type) -> None:
    """Tee the body on its way to the caller, or read it now if the transport already did."""
    # A transport may hand back a body it has read (MockTransport, ``Response(content=...)``):
    # no byte will pass the stream again, and ``_content`` holds it decoded.
    loaded = hasattr(response, "_content")
    call.response_started(response.status_code, read_headers(response.headers), decoded=loaded)
    if loaded:
        response._content = call.feed(response._content) + call.finish()
    else:
        response.stream = tee(response.stream, call)


def _make_sync(module: ModuleType, original: Callable[..., Any], tee: type, stack: str) -> Callable[..., Any]:
    from ._active import get_guard

    not_sent = _not_sent_errors(module)

    @functools.wraps(original)
    def _send_single_request(self: Any, request: Any) -> Any:
        if _scope.current() is not None:  # an outer seam examined this request already
            return original(self, request)
        token = _scope.enter(stack)
        try:
            return _guarded(self, request)
        finally:
            _scope.leave(token)

    def _guarded(self: Any, request: Any) -> Any:
        guard = get_guard()
        if guard is None:  # an unguarded process pays no URL string
            return original(self, request)
        url = str(request.url)  # httpx builds the string anew on every str()
        if not guard.wants(request.method, url):
            return original(self, request)
        call = guard.begin(request.method, url, request.headers, request.read())
        if call is None:
            return original(self, request)
        if call.blocked is not None:
            return _synthetic(module, call, request)
        request = _prepared(module, request, call)
        try:
            response = original(self, request)
        except not_sent as exc:
            call.failed(exc, sent=False)
            raise
        except BaseException as exc:
            call.failed(exc, sent=True)
            raise
        _observe(response, call, tee)
        return response

    return _send_single_request


def _make_async(module: ModuleType, original: Callable[..., Any], tee: type, stack: str) -> Callable[..., Any]:
    from ._active import get_guard

    not_sent = _not_sent_errors(module)

    @functools.wraps(original)
    async def _send_single_request(self: Any, request: Any) -> Any:
        if _scope.current() is not None:
            return await original(self, request)
        token = _scope.enter(stack)
        try:
            return await _guarded(self, request)
        finally:
            _scope.leave(token)

    async def _guarded(self: Any, request: Any) -> Any:
        guard = get_guard()
        if guard is None:  # as the sync one
            return await original(self, request)
        url = str(request.url)  # httpx builds the string anew on every str()
        if not guard.wants(request.method, url):
            return await original(self, request)
        # Each reservation is one synchronous ledger transaction; waiting for room between them awaits.
        call = await guard.abegin(request.method, url, request.headers, await request.aread())
        if call is None:
            return await original(self, request)
        if call.blocked is not None:
            return _synthetic(module, call, request)
        request = _prepared(module, request, call)
        try:
            response = await original(self, request)
        except not_sent as exc:
            call.failed(exc, sent=False)
            raise
        except BaseException as exc:
            call.failed(exc, sent=True)
            raise
        _observe(response, call, tee)
        return response

    return _send_single_request


def patch(module: ModuleType) -> None:
    """Instrument ``httpx`` or ``httpx2``. Idempotent."""
    if getattr(module, _MARK, False):
        return
    tee_sync, tee_async = _tee_classes(module)
    name = module.__name__
    for cls, method, make in _targets(module):
        tee = tee_async if make is _make_async else tee_sync
        stack = f"{name} ({cls.__name__}.{method})"
        setattr(cls, method, make(module, getattr(cls, method), tee, stack))
    setattr(module, _MARK, True)


def _targets(module: ModuleType) -> list[tuple[type, str, Callable[..., Any]]]:
    targets: list[tuple[type, str, Callable[..., Any]]] = [
        (module.Client, "_send_single_request", _make_sync),
        (module.AsyncClient, "_send_single_request", _make_async),
    ]
    # The transports are the second line; a version without them still gets the first.
    for name, method, make in (
        ("HTTPTransport", "handle_request", _make_sync),
        ("AsyncHTTPTransport", "handle_async_request", _make_async),
    ):
        cls = getattr(module, name, None)
        if cls is not None and hasattr(cls, method):
            targets.append((cls, method, make))
    return targets


def unpatch(module: ModuleType) -> None:
    if not getattr(module, _MARK, False):
        return
    for cls, method, _make in _targets(module):
        setattr(cls, method, getattr(cls, method).__wrapped__)
    setattr(module, _MARK, False)
