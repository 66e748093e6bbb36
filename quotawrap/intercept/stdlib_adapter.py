"""http.client (and urllib.request, which sends through it) and urllib3 used directly.

Seams: ``http.client.HTTPConnection.request``/``getresponse`` for programs that talk
http.client or urllib.request; ``urllib3.HTTPConnectionPool.urlopen`` for urllib3, whose
own ``HTTPConnection.request`` does not call http.client's but whose ``getresponse`` does.
Both are public methods every subclass inherits or calls through ``super()``, and below
every adapter a program may write for requests (a ``send`` override still ends in a pool's
``urlopen``). The body is observed in one place for both: the http.client response the
connection returns, its class swapped for a tee subclass (:func:`_tee_class`), so urllib3's decoding,
preloading and streaming all read through the tee.
"""

from __future__ import annotations

import functools
import io
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any

from . import _scope

TYPE_CHECKING = False
if TYPE_CHECKING:  # the guard (and its imports) load on the first guarded call
    from ..settling.call import GuardedCall

__all__ = ["patch_http_client", "patch_urllib3", "unpatch_http_client", "unpatch_urllib3"]

_MARK = "_quotawrap_patched"
_CALL = "_quotawrap_call"
_PIECE = 65536


def _body_bytes(body: Any) -> bytes | None:
    if body is None or isinstance(body, bytes):
        return body
    if isinstance(body, (bytearray, memoryview)):
        return bytes(body)
    if isinstance(body, str):
        return body.encode("utf-8")  # what http.client sends for a str body (it rejects non-latin-1 text)
    return None  # a file or an iterable: the guard refuses it rather than consume it


def _overridden(headers: Mapping[str, str] | None, call: GuardedCall) -> dict[str, str]:
    """The request's headers with the guard's overrides; Content-Length goes when the body changes."""
    drop = {name.lower() for name in call.HEADER_OVERRIDES}
    if call.new_body is not None:
        drop.add("content-length")
    out = {name: value for name, value in (headers or {}).items() if name.lower() not in drop}
    out.update(call.HEADER_OVERRIDES)
    return out


def _absolute(scheme: str, host: str, port: int | None, target: str) -> str:
    if target.startswith(("http://", "https://")):
        return target  # a request through a plain-HTTP proxy names the whole URL
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{scheme}://{host}:{port}{target}" if port else f"{scheme}://{host}{target}"


class _Wire:
    """Just enough of a socket for ``HTTPResponse`` to parse a locally made answer."""

    def __init__(self, data: bytes) -> None:
        self._data = data

    def makefile(self, _mode: str) -> io.BytesIO:
        return io.BytesIO(self._data)


def _synthetic(module: ModuleType, call: GuardedCall, method: str) -> Any:
    """The guard's refusal as a real ``http.client.HTTPResponse`` (urllib.request raises HTTPError on it)."""
    blocked = call.blocked
    assert blocked is not None
    reason = "Too Many Requests" if blocked.status == 429 else "Refused by quotawrap"
    head = f"HTTP/1.1 {blocked.status} {reason}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in blocked.headers)
    response = module.HTTPResponse(_Wire(head.encode("latin-1") + b"\r\n" + blocked.body), method=method)
    response.begin()
    return response


def _tee_class(module: ModuleType) -> type:
    _Base = module.HTTPResponse

    class TeeResponse(_Base):  # type: ignore[misc,valid-type]
        """An ``HTTPResponse`` whose reads pass through a :class:`GuardedCall`.

        Never instantiated: a response gets this class after ``begin()``; its state lives in
        ``__dict__``. The call may hold bytes back (a hidden usage chunk), so what the caller gets
        is served from a buffer of what the call handed on.
        """

        _quotawrap_call: GuardedCall
        _quotawrap_buf: bytearray
        _quotawrap_eof: bool

        def _quotawrap_fill(self, size: int, *, piece: bool) -> None:
            """Read until the call hands something on, or the body ends (then settle)."""
            call = self._quotawrap_call
            while not self._quotawrap_eof:
                try:
                    data = _Base.read1(self, size) if piece else _Base.read(self, size)
                except BaseException as exc:
                    call.failed(exc, sent=True)
                    raise
                if not data:
                    self._quotawrap_eof = True
                    self._quotawrap_buf += call.finish()
                    return
                out = call.feed(data)
                self._quotawrap_buf += out
                if out:
                    return

        def _quotawrap_take(self, size: int) -> bytes:
            buf = self._quotawrap_buf
            if size < 0 or size >= len(buf):
                out = bytes(buf)
                buf.clear()
            else:
                out = bytes(buf[:size])
                del buf[:size]
            return out

        def read(self, amt: int | None = None) -> bytes:
            if amt is None or amt < 0:
                while not self._quotawrap_eof:
                    self._quotawrap_fill(_PIECE, piece=False)
                return self._quotawrap_take(-1)
            if not self._quotawrap_buf:
                self._quotawrap_fill(amt, piece=False)
            return self._quotawrap_take(amt)

        def read1(self, n: int = -1) -> bytes:
            if not self._quotawrap_buf:
                self._quotawrap_fill(n if n > 0 else _PIECE, piece=True)
            return self._quotawrap_take(n)

        def readinto(self, b: Any) -> int:
            data = self.read(len(b))
            memoryview(b).cast("B")[: len(data)] = data
            return len(data)

        def peek(self, n: int = -1) -> bytes:
            if not self._quotawrap_buf:
                self._quotawrap_fill(_PIECE, piece=True)
            return bytes(self._quotawrap_buf)

        def readline(self, limit: int | None = -1) -> bytes:
            limit = -1 if limit is None else limit
            buf = self._quotawrap_buf
            while b"\n" not in buf and not self._quotawrap_eof and (limit < 0 or len(buf) < limit):
                self._quotawrap_fill(_PIECE, piece=True)
            end = buf.find(b"\n") + 1 or len(buf)
            return self._quotawrap_take(end if limit < 0 else min(end, limit))

        def isclosed(self) -> bool:
            return _Base.isclosed(self) and not self._quotawrap_buf

        def close(self) -> None:
            try:
                _Base.close(self)
            finally:
                self._quotawrap_call.close()

    return TeeResponse


def _observe(response: Any, call: GuardedCall, tee: type) -> None:
    call.response_started(response.status, response.msg, decoded=False)
    response.__dict__.update(_quotawrap_call=call, _quotawrap_buf=bytearray(), _quotawrap_eof=False)
    response.__class__ = tee


# -- http.client ---------------------------------------------------------------------------


def _connection_url(module: ModuleType, conn: Any, target: str) -> str:
    https = getattr(module, "HTTPSConnection", None)  # absent when Python has no ssl
    scheme = "https" if https is not None and isinstance(conn, https) else "http"
    tunnel = getattr(conn, "_tunnel_host", None)  # CONNECT through a proxy: the request is for the tunnel's end
    host, port = (tunnel, getattr(conn, "_tunnel_port", None)) if tunnel else (conn.host, conn.port)
    return _absolute(scheme, host, port, target)


def _make_request(module: ModuleType, original: Callable[..., Any]) -> Callable[..., Any]:
    from ._active import get_guard

    @functools.wraps(original)
    def request(
        self: Any, method: str, url: str, body: Any = None, headers: Any = None, *, encode_chunked: bool = False
    ) -> None:
        headers = {} if headers is None else headers
        if _scope.current() is not None:
            return original(self, method, url, body, headers, encode_chunked=encode_chunked)  # type: ignore[no-any-return]
        token = _scope.enter("http.client (HTTPConnection.request)")
        try:
            guard = get_guard()
            full = _connection_url(module, self, url)
            call = None
            if guard is not None and guard.wants(method, full):
                call = guard.begin(method, full, dict(headers), _body_bytes(body))
            if call is None:
                return original(self, method, url, body, headers, encode_chunked=encode_chunked)  # type: ignore[no-any-return]
            self.__dict__[_CALL] = call  # getresponse answers a refusal, or observes the answer
            if call.blocked is not None:
                return None
            body = body if call.new_body is None else call.new_body
            try:
                original(self, method, url, body, _overridden(headers, call), encode_chunked=encode_chunked)
            except BaseException as exc:
                self.__dict__.pop(_CALL, None)
                call.failed(exc, sent=self.sock is not None)  # no socket: the connection was never made
                raise
            return None
        finally:
            _scope.leave(token)

    return request


def _make_getresponse(module: ModuleType, original: Callable[..., Any]) -> Callable[..., Any]:
    tee = _tee_class(module)

    @functools.wraps(original)
    def getresponse(self: Any) -> Any:
        call = self.__dict__.pop(_CALL, None) or _scope.take_pending()
        if call is None:
            return original(self)
        if call.blocked is not None:
            return _synthetic(module, call, getattr(self, "_method", None) or "POST")
        try:
            response = original(self)
        except BaseException as exc:
            call.failed(exc, sent=True)
            raise
        _observe(response, call, tee)
        return response

    return getresponse


def patch_http_client(module: ModuleType) -> None:
    """Instrument ``http.client``. Idempotent."""
    conn = module.HTTPConnection
    if getattr(conn, _MARK, False):
        return
    conn.request = _make_request(module, conn.request)
    conn.getresponse = _make_getresponse(module, conn.getresponse)
    setattr(conn, _MARK, True)


def unpatch_http_client(module: ModuleType) -> None:
    conn = module.HTTPConnection
    if getattr(conn, _MARK, False):
        conn.request = conn.request.__wrapped__
        conn.getresponse = conn.getresponse.__wrapped__
        setattr(conn, _MARK, False)


# -- urllib3 -------------------------------------------------------------------------------


def _not_sent(module: ModuleType, exc: BaseException) -> bool:
    """A connection that was never made sent nothing (urllib3 wraps it in MaxRetryError)."""
    errors = module.exceptions
    never = tuple(
        getattr(errors, name)
        for name in ("NewConnectionError", "ConnectTimeoutError", "NameResolutionError", "LocationParseError")
        if hasattr(errors, name)
    )
    reason = getattr(exc, "reason", None) if isinstance(exc, errors.MaxRetryError) else exc
    return isinstance(reason, never)


def _urllib3_refusal(module: ModuleType, call: GuardedCall, method: str, url: str, kwargs: dict[str, Any]) -> Any:
    blocked = call.blocked
    assert blocked is not None
    return module.response.HTTPResponse(
        body=io.BytesIO(blocked.body),
        headers=module._collections.HTTPHeaderDict(list(blocked.headers)),
        status=blocked.status,
        reason="Too Many Requests" if blocked.status == 429 else "Refused by quotawrap",
        preload_content=kwargs.get("preload_content", True),
        decode_content=kwargs.get("decode_content", True),
        request_method=method,
        request_url=url,
    )


def _make_urlopen(module: ModuleType, original: Callable[..., Any]) -> Callable[..., Any]:
    from ._active import get_guard

    @functools.wraps(original)
    def urlopen(
        self: Any, method: str, url: str, body: Any = None, headers: Any = None, *args: Any, **kwargs: Any
    ) -> Any:
        if _scope.current() is not None:  # requests, or urllib3's own retry and redirect recursion
            return original(self, method, url, body, headers, *args, **kwargs)
        token = _scope.enter("urllib3 (HTTPConnectionPool.urlopen)")
        try:
            guard = get_guard()
            full = _absolute(self.scheme, self.host, self.port, url)
            merged = dict(self.headers if headers is None else headers)
            call = None
            if guard is not None and guard.wants(method, full):
                call = guard.begin(method, full, merged, _body_bytes(body))
            if call is None:
                return original(self, method, url, body, headers, *args, **kwargs)
            if call.blocked is not None:
                return _urllib3_refusal(module, call, method, full, kwargs)
            body = body if call.new_body is None else call.new_body
            if len(args) < 2:  # redirect not given by position: a pool's own redirect would go out unseen
                kwargs["redirect"] = False  # (PoolManager follows at its level, through this seam again)
            pending = _scope.set_pending(call)
            try:
                return original(self, method, url, body, _overridden(merged, call), *args, **kwargs)
            except BaseException as exc:
                call.failed(exc, sent=not _not_sent(module, exc))
                raise
            finally:
                _scope.reset_pending(pending)
        finally:
            _scope.leave(token)

    return urlopen


def _make_supports_chunked_reads(original: Callable[..., Any]) -> Callable[..., Any]:
    # urllib3 parses chunked framing itself from the response's socket file, past the tee.
    @functools.wraps(original)
    def supports_chunked_reads(self: Any) -> bool:
        return _CALL not in getattr(self._fp, "__dict__", ()) and bool(original(self))

    return supports_chunked_reads


def patch_urllib3(module: ModuleType) -> None:
    """Instrument ``urllib3`` (its responses are observed by the http.client patch). Idempotent."""
    pool = module.connectionpool.HTTPConnectionPool
    if getattr(pool, _MARK, False):
        return
    pool.urlopen = _make_urlopen(module, pool.urlopen)
    response = module.response.HTTPResponse
    response.supports_chunked_reads = _make_supports_chunked_reads(response.supports_chunked_reads)
    setattr(pool, _MARK, True)


def unpatch_urllib3(module: ModuleType) -> None:
    pool = module.connectionpool.HTTPConnectionPool
    if getattr(pool, _MARK, False):
        pool.urlopen = pool.urlopen.__wrapped__
        response = module.response.HTTPResponse
        response.supports_chunked_reads = response.supports_chunked_reads.__wrapped__
        setattr(pool, _MARK, False)
