"""aiohttp: wrap ``ClientSession._request``, the one coroutine ``get``/``post``/``request`` and
``aiohttp.request`` all await (``ClientRequest.send`` sits below the redirect loop and would
reserve each hop; the connector has no body).

The body is observed on the producer side: the response's ``StreamReader`` gets a subclass
whose ``feed_data``/``feed_eof``/``set_exception`` pass through the :class:`GuardedCall`, so
``read()``, ``json()``, ``content.iter_any()``, ``readline()`` and every other reader see the
same (possibly usage-hidden) bytes, and the call settles when the last byte arrives even if
nobody reads it. Closing or releasing the response early settles it as abandoned. Redirects
aiohttp follows inside ``_request`` go out under the call's hold, and the final answer settles it.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from types import ModuleType
from typing import Any

from . import _scope

TYPE_CHECKING = False
if TYPE_CHECKING:
    from ..settling.call import GuardedCall

__all__ = ["patch", "unpatch"]

_MARK = "_quotawrap_patched"
# StreamReader has __slots__: the call of a teed reader is kept here, by the reader's id,
# until its end, its error or its response's close.
_calls: dict[int, GuardedCall] = {}


def _tee_reader_class(module: ModuleType) -> type:
    base = module.streams.StreamReader

    class TeeStreamReader(base):  # type: ignore[misc,valid-type]
        __slots__ = ()  # same layout as StreamReader: instances get this class after creation

        def feed_data(self, data: bytes, *args: Any) -> Any:
            call = _calls.get(id(self))
            if call is not None and data:
                data = call.feed(data)
            return base.feed_data(self, data, *args)

        def feed_eof(self) -> None:
            call = _calls.pop(id(self), None)
            if call is not None:
                tail = call.finish()
                if tail:
                    base.feed_data(self, tail)
            base.feed_eof(self)

        def set_exception(self, exc: BaseException, *args: Any) -> None:
            call = _calls.pop(id(self), None)
            if call is not None:
                call.failed(exc, sent=True)
            base.set_exception(self, exc, *args)

    return TeeStreamReader


def _observe(module: ModuleType, tee: type, response: Any, call: GuardedCall, decoded: bool) -> None:
    call.response_started(response.status, response.headers, decoded=decoded)
    content = response.content
    if not isinstance(content, module.streams.StreamReader) or isinstance(content, module.streams.EmptyStreamReader):
        call.finish()  # no body at all
        return
    # What arrived with the headers is in the buffer already (a short answer may be complete):
    # take it out and feed it again through the tee.
    try:
        early = content.read_nowait(-1)
    except Exception as exc:
        call.failed(exc, sent=True)
        return
    complete = content.is_eof()
    content.__class__ = tee
    _calls[id(content)] = call
    if complete:
        content._eof = False  # reopened for the teed bytes, then closed again by the tee
    if early:
        content.feed_data(early)
    if complete:
        content.feed_eof()


class _Quiet:
    """The protocol a locally made answer's StreamReader never needs to pause."""

    def pause_reading(self) -> None:
        pass

    def resume_reading(self, *args: Any, **kwargs: Any) -> None:
        pass


class _NoWriter:
    output_size = 0


def _synthetic(module: ModuleType, session: Any, method: str, url: Any, call: GuardedCall) -> Any:
    """The guard's refusal as a real ``ClientResponse`` (``raise_for_status`` raises on it as on any 429)."""
    import asyncio

    from multidict import CIMultiDict, CIMultiDictProxy

    blocked = call.blocked
    assert blocked is not None
    loop = asyncio.get_running_loop()
    headers = CIMultiDictProxy(CIMultiDict(list(blocked.headers)))
    offered: dict[str, Any] = {
        "writer": None,
        "continue100": None,
        "timer": None,
        "request_info": module.RequestInfo(url, method, headers, url),
        "traces": [],
        "loop": loop,
        "session": session,
        "stream_writer": _NoWriter(),
    }
    accepted = inspect.signature(module.ClientResponse.__init__).parameters
    response = module.ClientResponse(method, url, **{k: v for k, v in offered.items() if k in accepted})
    response.version = module.HttpVersion11
    response.status = blocked.status
    # raise_for_status() puts the reason into its error, and clients (litellm's aiohttp provider)
    # show only that: the reason carries quotawrap's message, not just "Too Many Requests".
    response.reason = _message(blocked.body) or ("Too Many Requests" if blocked.status == 429 else "Refused")
    response._headers = headers
    response._raw_headers = tuple((k.encode(), v.encode()) for k, v in blocked.headers)
    content = module.streams.StreamReader(_Quiet(), 2**16, loop=loop)
    content.feed_data(blocked.body)
    content.feed_eof()
    response.content = content
    return response


def _message(body: bytes) -> str | None:
    import json

    try:
        message = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return None
    return str(message) if isinstance(message, str) else None


def _make_request(module: ModuleType, original: Callable[..., Any], tee: type) -> Callable[..., Any]:
    from ._active import get_guard

    errors = module.client_exceptions
    never_sent = tuple(
        getattr(errors, name)
        for name in ("ClientConnectorError", "InvalidURL", "ConnectionTimeoutError")
        if hasattr(errors, name)
    )

    @functools.wraps(original)
    async def _request(self: Any, method: str, str_or_url: Any, **kwargs: Any) -> Any:
        if _scope.current() is not None:  # openai's aiohttp transport under a guarded httpx2 client
            return await original(self, method, str_or_url, **kwargs)
        token = _scope.enter("aiohttp (ClientSession._request)")
        try:
            return await _guarded(self, method, str_or_url, kwargs)
        finally:
            _scope.leave(token)

    async def _guarded(self: Any, method: str, str_or_url: Any, kwargs: dict[str, Any]) -> Any:
        guard = get_guard()
        url = self._build_url(str_or_url) if hasattr(self, "_build_url") else _url(str_or_url)
        if guard is None or not guard.wants(method, str(url)):
            return await original(self, method, str_or_url, **kwargs)
        # waiting for room awaits: the loop's other tasks go on
        call = await guard.abegin(method, str(url), _merged_headers(self, kwargs.get("headers")), _body(self, kwargs))
        if call is None:
            return await original(self, method, str_or_url, **kwargs)
        if call.blocked is not None:
            response = _synthetic(module, self, method, url, call)
            await _raise_for_status(self, kwargs, response)
            return response
        _rewrite(kwargs, call)
        try:
            response = await original(self, method, str_or_url, **kwargs)
        except errors.ClientResponseError as exc:  # raise_for_status: the provider refused, nothing billed
            call.failed(exc, sent=(exc.status or 0) < 400)
            raise
        except never_sent as exc:
            call.failed(exc, sent=False)
            raise
        except BaseException as exc:
            call.failed(exc, sent=True)
            raise
        decompress = kwargs.get("auto_decompress")
        decoded = getattr(self, "_auto_decompress", True) if decompress is None else bool(decompress)
        _observe(module, tee, response, call, decoded)
        return response

    return _request


def _url(str_or_url: Any) -> Any:
    from yarl import URL

    return URL(str_or_url)


def _merged_headers(session: Any, headers: Any) -> Any:
    prepare = getattr(session, "_prepare_headers", None)
    return prepare(headers) if prepare is not None else dict(headers or {})


def _body(session: Any, kwargs: dict[str, Any]) -> bytes | None:
    if kwargs.get("json") is not None:
        dumps_bytes = getattr(session, "_json_serialize_bytes", None)
        if dumps_bytes is not None:
            return bytes(dumps_bytes(kwargs["json"]))
        return str(session._json_serialize(kwargs["json"])).encode("utf-8")
    data = kwargs.get("data")
    if isinstance(data, (bytes, bytearray, memoryview)):
        return bytes(data)
    if isinstance(data, str):
        return data.encode("utf-8")
    return None  # a form, a file, a generator: the guard refuses it rather than consume it


def _rewrite(kwargs: dict[str, Any], call: GuardedCall) -> None:
    """Identity encoding, and the usage-asking body if the guard made one."""
    from multidict import CIMultiDict

    headers = CIMultiDict(kwargs.get("headers") or {})
    for name, value in call.HEADER_OVERRIDES.items():
        headers[name] = value
    if call.new_body is not None:
        kwargs["json"] = None
        kwargs["data"] = call.new_body
        headers.pop("Content-Length", None)
        headers.setdefault("Content-Type", "application/json")
    kwargs["headers"] = headers


async def _raise_for_status(session: Any, kwargs: dict[str, Any], response: Any) -> None:
    check = kwargs.get("raise_for_status")
    if check is None:
        check = getattr(session, "_raise_for_status", False)
    if callable(check):
        await check(response)
    elif check:
        response.raise_for_status()


def _make_settle_on(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def closing(self: Any, *args: Any, **kwargs: Any) -> Any:
        call = _calls.pop(id(getattr(self, "content", None)), None)
        try:
            return original(self, *args, **kwargs)
        finally:
            if call is not None:
                call.close()  # closed before its end: abandoned (a no-op once settled)

    return closing


def patch(module: ModuleType) -> None:
    """Instrument ``aiohttp``. Idempotent."""
    session = module.ClientSession
    if getattr(session, _MARK, False):
        return
    tee = _tee_reader_class(module)
    session._request = _make_request(module, session._request, tee)
    module.ClientResponse.close = _make_settle_on(module.ClientResponse.close)
    module.ClientResponse.release = _make_settle_on(module.ClientResponse.release)
    setattr(session, _MARK, True)


def unpatch(module: ModuleType) -> None:
    session = module.ClientSession
    if getattr(session, _MARK, False):
        session._request = session._request.__wrapped__
        module.ClientResponse.close = module.ClientResponse.close.__wrapped__
        module.ClientResponse.release = module.ClientResponse.release.__wrapped__
        setattr(session, _MARK, False)
