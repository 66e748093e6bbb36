"""requests: wrap ``HTTPAdapter.send``, once per network hop (redirects included).

``Session.send`` would see a redirect chain as one call and reads non-streamed bodies
itself; the adapter's ``send`` returns the response before its body is read (urllib3's
``preload_content=False``), so one tee on ``response.raw`` covers ``stream=True`` and not.
"""

from __future__ import annotations

import datetime
import functools
import io
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

from . import _scope

TYPE_CHECKING = False
if TYPE_CHECKING:  # the guard (and its imports) load on the first guarded call, not with the client
    from ..settling.call import GuardedCall

__all__ = ["patch", "unpatch"]

_MARK = "_quotawrap_patched"


class _TeeRaw:
    """Stands in for the urllib3 response: tees what ``stream``/``read`` hand out."""

    _inner: Any
    _call: GuardedCall

    def __init__(self, inner: Any, call: GuardedCall) -> None:
        self.__dict__["_inner"] = inner
        self.__dict__["_call"] = call

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._inner, name, value)

    def stream(self, amt: int | None = 2**16, decode_content: bool | None = None) -> Iterator[bytes]:
        yield from self._call.tee(self._inner.stream(amt, decode_content=decode_content))

    def read(self, amt: int | None = None, decode_content: bool | None = None, **kwargs: Any) -> bytes:
        while True:
            try:
                data = self._inner.read(amt, decode_content=decode_content, **kwargs)
            except BaseException as exc:
                self._call.failed(exc, sent=True)
                raise
            if not data:
                return self._call.finish()
            out = self._call.feed(data)
            if amt is None:  # read() without a size returns the whole rest of the body: that is its end
                return out + self._call.finish()
            if out:  # the SSE reader may hold bytes back while it hides an event; b"" would mean EOF
                return out

    def close(self) -> None:
        try:
            self._inner.close()
        finally:
            self._call.close()

    def release_conn(self) -> None:
        try:
            self._inner.release_conn()
        finally:
            self._call.close()


def _synthetic(module: ModuleType, call: GuardedCall, request: Any) -> Any:
    assert call.blocked is not None
    response = module.Response()
    response.status_code = call.blocked.status
    response.headers = module.structures.CaseInsensitiveDict(dict(call.blocked.headers))
    response._content = call.blocked.body
    response._content_consumed = True
    response.raw = io.BytesIO(call.blocked.body)
    response.encoding = "utf-8"
    response.reason = "Too Many Requests" if call.blocked.status == 429 else "Refused by quotawrap"
    response.url = request.url
    response.request = request
    response.elapsed = datetime.timedelta(0)
    return response


def _body_bytes(body: Any) -> bytes | None:
    if body is None or isinstance(body, bytes):
        return body
    if isinstance(body, str):
        return body.encode("utf-8")
    return None  # a file or generator body: the guard refuses it rather than consume it


def _make_send(module: ModuleType, original: Callable[..., Any]) -> Callable[..., Any]:
    from ._active import get_guard

    exceptions = module.exceptions

    @functools.wraps(original)
    def send(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        if _scope.current() is not None:  # an outer seam examined this request already
            return original(self, request, *args, **kwargs)
        token = _scope.enter("requests (HTTPAdapter.send)")
        try:
            return _guarded(self, request, *args, **kwargs)
        finally:
            _scope.leave(token)

    def _guarded(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        guard = get_guard()
        if guard is None or not guard.wants(request.method or "", request.url or ""):
            return original(self, request, *args, **kwargs)
        call = guard.begin(request.method, request.url, request.headers, _body_bytes(request.body))
        if call is None:
            return original(self, request, *args, **kwargs)
        if call.blocked is not None:
            return _synthetic(module, call, request)
        request = request.copy()
        for name, value in call.HEADER_OVERRIDES.items():
            request.headers[name] = value
        if call.new_body is not None:
            request.body = call.new_body
            request.headers["Content-Length"] = str(len(call.new_body))
        try:
            response = original(self, request, *args, **kwargs)
        except (exceptions.ConnectTimeout, exceptions.InvalidURL, exceptions.InvalidSchema) as exc:
            call.failed(exc, sent=False)
            raise
        except exceptions.ConnectionError as exc:
            call.failed(exc, sent=_maybe_sent(exc))
            raise
        except BaseException as exc:
            call.failed(exc, sent=True)
            raise
        # requests hands out decoded bytes (decode_content=True), so the tee reads plain text.
        call.response_started(response.status_code, response.headers, decoded=True)
        response.raw = _TeeRaw(response.raw, call)
        return response

    return send


def _maybe_sent(exc: BaseException) -> bool:
    """A refused connection never sent anything; anything else might have."""
    reason = getattr(exc.args[0], "reason", None) if exc.args else None
    name = type(reason).__name__ if reason is not None else ""
    return name not in {"NewConnectionError", "NameResolutionError"}


def patch(module: ModuleType) -> None:
    """Instrument ``requests``. Idempotent."""
    adapter = module.adapters.HTTPAdapter
    if getattr(adapter, _MARK, False):
        return
    adapter.send = _make_send(module, adapter.send)
    setattr(adapter, _MARK, True)


def unpatch(module: ModuleType) -> None:
    adapter = module.adapters.HTTPAdapter
    if getattr(adapter, _MARK, False):
        adapter.send = adapter.send.__wrapped__
        setattr(adapter, _MARK, False)
