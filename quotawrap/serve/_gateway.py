"""The gateway: an aiohttp server that drives the one :class:`Guard` exactly as the httpx adapter does.

Per request: ``Guard.begin`` reserves (or refuses with its synthetic answer), the request goes
upstream with the guard's header overrides and body, and every body chunk passes through
``GuardedCall.feed`` on its way to the caller as it arrives; ``finish`` settles at the end,
``close`` when the caller or the upstream goes away first, ``failed`` when nothing was sent.

Each client connection passes a gate (:class:`_Connection`): at most ``--max-connections`` are held
at once (one more is answered 503 and closed), and one that has not sent a request's headers within
``--header-timeout`` of opening is closed (aiohttp's keep-alive timeout, set to the same value, closes
one that dawdles over a later request's). A body above ``--max-body-mib`` is answered 413 unread; a
big one is admitted (parsed, its tokens counted) on a thread, so the loop keeps relaying every other
stream meanwhile. aiohttp's complaints about malformed requests are one line each, not a traceback.
The upstream URL's credentials are never shown: health, the start line, warnings and 502s name it
with its password hidden.

With ``--upstream-key-env`` the gateway holds the provider's key and takes member keys instead
(:mod:`._members`): a request without a good one is answered 401 before its body is read, and one with
it goes upstream with the provider's key, guarded under its key's tags.

The upstream client is aiohttp's, like the server: it costs the gateway less per call than
``httpx.AsyncClient`` and carries more guarded requests per second (docs/benchmarks.md). No hook may
run in this process (it would reserve the gateway's upstream calls a second time): the CLI starts
``serve`` and ``--proxy`` without it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import socket
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar, cast
from urllib.parse import urlsplit

import aiohttp
from aiohttp import web
from multidict import CIMultiDict
from yarl import URL

from ..admission.guard import Guard
from ..config.settings import Settings
from ..core.errors import ConfigError
from ..core.member_keys import MemberKey, member_tags
from ..core.redact import redact_text, redact_url
from ..core.synthetic import SyntheticResponse
from ..dashboard.pages import DASHBOARD_PATH, Answer, Pages, addressed_here
from ..ledger import CallPath
from ..ledger.base import run_key
from ..settling.call import GuardedCall
from ..support.log import warn
from ._http import (
    ARK_BASE_URL,
    HEALTH_PATH,
    METRICS_PATH,
    RESERVED_PREFIX,
    TAG_HEADER,
    forwarded_request_headers,
    forwarded_response_headers,
    header_tags,
    split_credentials,
    upstream_url,
)
from ._members import MemberGate

__all__ = ["Gateway"]

_MIB = 1024 * 1024
# A bigger body is admitted on a thread: counting its tokens costs more than the hop there.
_INLINE_BODY = 16 * 1024
_ESTIMATE_THREADS = 4
_TURNED_AWAY_S = 1.0  # how long a connection over the limit may take to read its 503 before it is cut
_GUARDS_KEPT = 256  # one Guard per distinct set of header tags
_NOT_SENT = (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError, aiohttp.InvalidURL)
_LEDGER_THREADS = 16
_T = TypeVar("_T")


class _Relayed(web.StreamResponse):
    """An upstream answer: its headers leave with its first bytes, in one write (each send is a system call)."""

    _send_headers_immediately = False


def _env_proxy(url: str) -> URL | None:
    """The HTTP(S)_PROXY / NO_PROXY answer for the upstream, looked up once, not on every call."""
    try:
        proxy, _auth = aiohttp.helpers.get_env_proxy_for_url(URL(url))
    except LookupError:
        return None
    return proxy


def _never_sent(call: GuardedCall | None) -> None:
    """A reservation whose request was given up before it went out: release it."""
    if call is not None:
        call.failed(asyncio.CancelledError(), sent=False)


def _hand_over(done: Future[_T], abandon: Callable[[_T], None]) -> None:
    if not done.cancelled() and done.exception() is None:
        abandon(done.result())


def _answer(synthetic: SyntheticResponse) -> web.Response:
    return web.Response(status=synthetic.status, body=synthetic.body, headers=CIMultiDict(synthetic.headers))


def _page(answer: Answer) -> web.Response:
    headers = CIMultiDict(answer.headers)
    headers["Content-Type"] = answer.content_type
    return web.Response(status=answer.status, body=answer.body, headers=headers)


def _too_large(size: int | None, limit: int) -> web.Response:
    told = f"this one has {size:,} bytes" if size is not None else "this one is longer"
    message = (
        f"quotawrap's gateway reads request bodies up to {limit // _MIB} MiB and {told}; it was not sent."
        " Raise the limit with --max-body-mib (QUOTAWRAP_MAX_BODY_MIB)."
    )
    return _answer(SyntheticResponse.ark_error(413, "QuotawrapRequestTooLarge", "RequestEntityTooLarge", message))


def _busy_answer(limit: int) -> bytes:
    """The whole HTTP answer to a connection over the limit, written before anything is read from it."""
    message = (
        f"quotawrap's gateway holds {limit} client connections at once (--max-connections,"
        " QUOTAWRAP_MAX_CONNECTIONS) and all are taken; try again shortly."
    )
    synthetic = SyntheticResponse.ark_error(503, "QuotawrapTooManyConnections", "ServiceUnavailable", message)
    head = "".join(f"{name}: {value}\r\n" for name, value in synthetic.headers if name != "x-should-retry")
    return f"HTTP/1.1 503 Service Unavailable\r\n{head}connection: close\r\n\r\n".encode() + synthetic.body


class _OneLine(logging.Handler):
    """aiohttp's server log as quotawrap's one line each: under --proxy it lands in the user's terminal,
    where a malformed request's traceback is noise about someone else's bytes."""

    def emit(self, record: logging.LogRecord) -> None:
        line = record.getMessage()
        if record.exc_info and record.exc_info[1] is not None:
            exc = record.exc_info[1]
            detail = " ".join(str(exc).split())  # the parser's message spans lines, with a caret drawing
            line = f"{line}: {type(exc).__name__}: {detail}" if detail else f"{line}: {type(exc).__name__}"
        warn(f"gateway: {redact_text(line)[:500]}")


def _loop_error(_loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """The event loop's complaints (a callback that raised, a task nobody awaited) as one line too."""
    exc = context.get("exception")
    reason = f": {type(exc).__name__}: {exc}" if exc is not None else ""
    warn(f"gateway: {redact_text(str(context.get('message', 'event loop error')) + reason)[:500]}")


def _server_log() -> logging.Logger:
    log = logging.getLogger("quotawrap.gateway")
    if not log.handlers:
        log.addHandler(_OneLine())
        log.propagate = False  # nothing reaches the root logger's (or Python's last-resort) traceback printer
    return log


class _Gate:
    """What every connection of one gateway shares: the count of those open, and the limits."""

    def __init__(self, factory: Callable[[], asyncio.Protocol], limit: int, header_timeout: float) -> None:
        self.factory = factory
        self.limit = limit
        self.header_timeout = header_timeout
        self.open = 0
        self.busy = _busy_answer(limit)


class _Connection(asyncio.Protocol):
    """One client connection in front of aiohttp's protocol: counted against the limit (one more is answered
    503 and closed), and closed when its first request's headers have not all arrived in time. Later
    requests on the connection are timed by aiohttp's keep-alive timeout, set to the same value."""

    def __init__(self, gate: _Gate) -> None:
        self._gate = gate
        self._inner: asyncio.Protocol | None = None
        self._deadline: asyncio.TimerHandle | None = None
        self._tail = b""  # the last bytes before this chunk: a head's blank line may straddle two chunks

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        gate = self._gate
        loop = asyncio.get_running_loop()
        if gate.open >= gate.limit:
            # Answered at once, then only our side is shut: a close with the caller's request still unread
            # would reset the connection, and a reset may cost the caller the answer. It has a moment to read it.
            transport = cast(asyncio.Transport, transport)  # uvloop's transports are not asyncio's classes
            transport.write(gate.busy)
            transport.write_eof()
            self._deadline = loop.call_later(_TURNED_AWAY_S, transport.abort)
            return
        gate.open += 1
        self._inner = gate.factory()
        self._deadline = loop.call_later(gate.header_timeout, transport.close)
        self._inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self._inner is None:
            return  # turned away: its request is read and dropped
        if self._deadline is not None:
            seen = self._tail + data
            if b"\r\n\r\n" in seen or b"\n\n" in seen:  # the first request's head is complete
                self._deadline.cancel()
                self._deadline = None
            else:
                self._tail = seen[-3:]
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received() if self._inner is not None else None  # None: the transport closes

    def pause_writing(self) -> None:
        if self._inner is not None:
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        if self._inner is not None:
            self._inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        inner, self._inner = self._inner, None
        if inner is not None:
            self._gate.open -= 1
            inner.connection_lost(exc)


class Gateway:
    """One listening gateway: its settings, its ledger, its upstream and what it has in flight."""

    def __init__(
        self,
        settings: Settings,
        ledger: CallPath,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        drain_timeout: float = 30.0,
        members: MemberGate | None = None,
        pages: Pages | None = None,
        metrics: Callable[[], tuple[str, bytes]] | None = None,
    ) -> None:
        """``metrics``: the Prometheus exposition (content type, body) answered at ``GET /metrics``."""
        self.settings = settings
        self.members = members  # None: the caller's own key goes upstream
        self.pages = pages  # the dashboard, at DASHBOARD_PATH
        self.metrics = metrics
        self.ledger = ledger
        given = settings.base_url[0] if settings.base_url else ARK_BASE_URL
        self.upstream, self._upstream_auth = split_credentials(given)
        self.shown_upstream = redact_url(given)  # what health, the start line and every message name
        # The guard must see the upstream as guarded whatever it is (Ark's hosts already are).
        if self.upstream not in settings.base_url:
            settings = settings.replace(base_url=(*settings.base_url, self.upstream))
        self._settings = settings
        self._run_id = settings.run_id or "gateway"
        self.host = host
        self.port = port
        self.drain_timeout = drain_timeout
        self.in_flight = 0
        self.draining = False
        self._guards: collections.OrderedDict[tuple[tuple[str, str], ...], Guard] = collections.OrderedDict()
        self._base_tags = dict(entry.partition("=")[::2] for entry in settings.tag if "=" in entry)
        self._client: aiohttp.ClientSession | None = None
        self._proxy: URL | None = None
        self._runner: web.AppRunner | None = None
        # A network ledger's round trips (and a Redis outage's timeouts) run on threads, so they never
        # stall the loop and the streams it relays; a local SQLite transaction costs less
        # than the hop, and runs inline.
        remote = urlsplit(settings.store or "sqlite:").scheme not in ("", "sqlite")
        self._ledger_pool = ThreadPoolExecutor(_LEDGER_THREADS, "quotawrap-ledger") if remote else None
        self._estimate_pool: ThreadPoolExecutor | None = None  # a local ledger's big bodies, made when one comes
        self._max_body = settings.max_body_mib * _MIB
        self._listener: asyncio.AbstractServer | None = None
        self.admitting = 0  # requests being admitted (parsed, estimated, reserved) now: health shows it
        self.started_at = time.time()

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    # -- lifecycle ----------------------------------------------------------------------------

    async def start(self) -> str:
        """Bind, listen, and return the gateway's base URL (the port is known once bound)."""
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self.host, self.port))
        except OSError:
            sock.close()
            raise
        self.port = int(sock.getsockname()[1])
        self._client = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=30.0, sock_read=600.0),
            auto_decompress=False,
            skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding"),
        )
        self._proxy = _env_proxy(self.upstream)
        app = web.Application(client_max_size=self._max_body)
        app.router.add_get(HEALTH_PATH, self._health)
        if self.metrics is not None:
            app.router.add_get(METRICS_PATH, self._metrics)
        if self.pages is not None:
            app.router.add_get(DASHBOARD_PATH.rstrip("/"), self._to_dashboard)
            app.router.add_get(DASHBOARD_PATH + "{name:[^/]*}", self._dashboard)
        app.router.add_route("*", RESERVED_PREFIX + "{tail:.*}", self._reserved)
        app.router.add_route("*", "/{tail:.*}", self._forward)
        self._runner = web.AppRunner(
            app,
            access_log=None,
            handle_signals=False,
            shutdown_timeout=self.drain_timeout,
            logger=_server_log(),
            keepalive_timeout=self._settings.header_timeout,
        )
        await self._runner.setup()
        factory = self._runner.server
        assert factory is not None
        gate = _Gate(factory, self._settings.max_connections, self._settings.header_timeout)
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(_loop_error)
        self._listener = await loop.create_server(lambda: _Connection(gate), sock=sock, backlog=1024)
        return self.url

    async def stop(self) -> None:
        """Stop accepting, let calls in flight finish (up to ``drain_timeout``) and settle, then close.

        A call still running at the deadline is cancelled, which closes its GuardedCall: the hold
        is charged whole (its outcome is unknown), never dropped.
        """
        self.draining = True
        if self._listener is not None:
            self._listener.close()  # accept nothing more; the runner drains the connections already open
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._client is not None:
            await self._client.close()
            self._client = None
        for pool in (self._ledger_pool, self._estimate_pool):
            if pool is not None:
                pool.shutdown(wait=True)

    async def _off_loop(
        self, fn: Callable[..., _T], *args: Any, abandon: Callable[[_T], None] | None = None, heavy: bool = False
    ) -> _T:
        """Run a step that touches the ledger: on a thread for a network ledger, or when ``heavy`` (a big
        body's estimate), else inline.

        ``abandon`` gets the step's result if the caller was cancelled (the drain deadline) while it ran.
        """
        pool = self._ledger_pool
        if pool is None and heavy:
            if self._estimate_pool is None:
                self._estimate_pool = ThreadPoolExecutor(_ESTIMATE_THREADS, "quotawrap-estimate")
            pool = self._estimate_pool
        if pool is None:
            return fn(*args)
        job = pool.submit(fn, *args)
        try:
            return await asyncio.wrap_future(job)
        except asyncio.CancelledError:
            if abandon is not None:
                job.add_done_callback(lambda done: _hand_over(done, abandon))
            raise

    async def _admit(
        self, guard: Guard, method: str, url: str, headers: Mapping[str, str], body: bytes
    ) -> GuardedCall | None:
        """``Guard.begin`` whose waits for room are awaited: a blocking wait would stall the very calls
        whose settles make the room (SQLite runs inline) or hold a ledger thread each (Redis)."""
        steps = guard.admission(method, url, headers, body)

        def step() -> tuple[bool, Any]:
            try:
                return False, next(steps)
            except StopIteration as done:
                return True, done.value

        def abandon(result: tuple[bool, Any]) -> None:
            if result[0]:
                _never_sent(result[1])

        heavy = len(body) > _INLINE_BODY
        self.admitting += 1
        try:
            while True:
                finished, value = await self._off_loop(step, abandon=abandon, heavy=heavy)
                if finished:
                    return value  # type: ignore[no-any-return]
                await asyncio.sleep(value)
        finally:
            self.admitting -= 1
            with contextlib.suppress(ValueError):  # still running on a ledger thread: it ends by itself
                steps.close()  # a cancelled wait leaves its place in line

    # -- handlers -----------------------------------------------------------------------------

    async def _health(self, request: web.Request) -> web.Response:
        """Liveness and readiness: the ledger answers, and the gateway is not draining."""
        body: dict[str, Any] = {
            "status": "ok",
            "upstream": self.shown_upstream,
            "run_id": self.settings.run_id,
            "in_flight": self.in_flight,
            "admitting": self.admitting,
            "uptime_s": round(time.time() - self.started_at, 3),
            "member_keys": self.members is not None,
        }
        status = 200
        try:
            await self._off_loop(self.ledger.counters, [run_key(self._run_id)])  # one real read
        except Exception as exc:
            body.update(status="ledger unavailable", error=redact_text(str(exc)))
            status = 503
        if self.draining:
            body["status"] = "draining"
            status = 503
        return web.json_response(body, status=status)

    async def _metrics(self, request: web.Request) -> web.Response:
        """The store's figures for Prometheus, read on a thread (a scrape reads the day's calls)."""
        assert self.metrics is not None
        try:
            content_type, body = await asyncio.get_running_loop().run_in_executor(None, self.metrics)
        except Exception as exc:
            text = f"quotawrap: cannot read the store for /metrics: {redact_text(str(exc))}\n"
            return web.Response(status=503, text=text)
        return web.Response(body=body, headers={"Content-Type": content_type})

    async def _dashboard(self, request: web.Request) -> web.Response:
        """A page of the dashboard; its data is read from the store on a thread, off the loop that relays calls."""
        assert self.pages is not None
        if not addressed_here(request.headers.get("Host"), self.host):
            return _page(self.pages.refused(request.headers.get("Host")))
        answer = await asyncio.get_running_loop().run_in_executor(None, self.pages.answer, request.match_info["name"])
        return _page(answer)

    async def _to_dashboard(self, request: web.Request) -> web.Response:
        raise web.HTTPFound(DASHBOARD_PATH)  # the page's relative links need the trailing slash

    async def _reserved(self, request: web.Request) -> web.Response:
        """quotawrap's prefix is never forwarded: a path under it that names nothing is answered here."""
        shown = "health, dashboard/" if self.pages is not None else "health"
        return _page(
            Answer(
                404,
                "text/plain; charset=utf-8",
                f"quotawrap keeps {RESERVED_PREFIX} for its own pages ({shown})\n".encode(),
            )
        )

    def _guard_for(self, tags: Mapping[str, str]) -> Guard:
        key = tuple(sorted(tags.items()))
        guard = self._guards.get(key)
        if guard is None:
            merged = {**self._base_tags, **tags}
            settings = self._settings.replace(tag=tuple(f"{k}={v}" for k, v in merged.items()))
            guard = self._guards[key] = Guard(settings, self.ledger)
            if len(self._guards) > _GUARDS_KEPT:
                self._guards.popitem(last=False)
        else:
            self._guards.move_to_end(key)
        return guard

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        self.in_flight += 1
        try:
            return await self._forward_one(request)
        finally:
            self.in_flight -= 1

    async def _forward_one(self, request: web.Request) -> web.StreamResponse:
        assert self._client is not None
        if request.content_length is not None and request.content_length > self._max_body:
            return _too_large(request.content_length, self._max_body)  # unread: aiohttp then closes the connection
        member: MemberKey | None = None
        if self.members is not None:  # before the body is read: a stranger's is not
            admitted = await self._off_loop(self.members.admit, request.headers)
            if not isinstance(admitted, MemberKey):
                return _answer(admitted)
            member = admitted
        try:
            body = await request.read()
        except web.HTTPRequestEntityTooLarge:  # a chunked body past the limit
            return _too_large(None, self._max_body)
        url = upstream_url(self.upstream, request.rel_url.raw_path, request.rel_url.raw_query_string)
        headers = forwarded_request_headers(request.headers.items())
        if self.members is not None:
            headers = self.members.upstream_headers(headers)
        elif self._upstream_auth is not None and "authorization" not in request.headers:
            headers.append(("Authorization", self._upstream_auth))  # the --base-url's own credentials
        try:
            tags = self._tags(request, member)
        except ConfigError as exc:
            return _answer(SyntheticResponse.ark_error(400, "QuotawrapBadTag", "BadRequest", f"{TAG_HEADER}: {exc}"))
        guard = self._guard_for(tags)
        call = await self._admit(guard, request.method, url, request.headers, body)
        if call is not None:
            if call.blocked is not None:
                return _answer(call.blocked)
            body = call.new_body if call.new_body is not None else body
            overrides = {name.lower() for name in call.HEADER_OVERRIDES}
            headers = [(n, v) for n, v in headers if n.lower() not in overrides]
            headers.extend(call.HEADER_OVERRIDES.items())
        try:
            upstream = await self._client.request(
                request.method,
                URL(url, encoded=True),
                headers=headers,
                data=body,
                allow_redirects=False,
                proxy=self._proxy,
            )
        except _NOT_SENT as exc:
            if call is not None:
                call.failed(exc, sent=False)
            return self._unreachable(exc)
        except BaseException as exc:
            if call is not None:
                call.failed(exc, sent=True)
            if isinstance(exc, Exception):
                return self._unreachable(exc)
            raise
        try:
            return await self._relay(request, upstream, call)
        finally:
            upstream.release()

    @staticmethod
    def _tags(request: web.Request, member: MemberKey | None) -> dict[str, str]:
        """The call's tags over the gateway's: a member's key's, else the caller's header's."""
        asked = request.headers.getall(TAG_HEADER, [])
        if member is None:
            return header_tags(asked)
        if asked:  # a member could otherwise charge its calls to another member's or team's budget
            raise ConfigError("a member's calls carry its key's tags (quotawrap keys add --tag); send none")
        return member_tags(member)

    async def _relay(
        self, request: web.Request, upstream: aiohttp.ClientResponse, call: GuardedCall | None
    ) -> web.StreamResponse:
        """The upstream's answer, chunk by chunk as it arrives, through the call's tee."""
        event_stream = "text/event-stream" in upstream.headers.get("content-type", "")
        pairs = [(name.decode("latin-1"), value.decode("latin-1")) for name, value in upstream.raw_headers]
        headers = forwarded_response_headers(pairs, keep_length=not event_stream)
        response = _Relayed(status=upstream.status, reason=upstream.reason or None)
        for name, value in headers:
            response.headers.add(name, value)
        try:
            if self.members is not None:
                self.members.upstream_answered(upstream.status)
            if call is not None:
                call.response_started(upstream.status, upstream.headers)
            await response.prepare(request)
            async for chunk in upstream.content.iter_any():
                out = call.feed(chunk) if call is not None else chunk
                if out:
                    await response.write(out)
        except BaseException:
            # The caller went away, the upstream broke off, or the drain deadline cancelled us:
            # usage already seen settles, otherwise the hold is charged whole.
            if call is not None:
                call.close()
            raise
        # The whole answer has passed the tee: it settles from it, whatever the caller does now.
        if call is None:
            await response.write_eof()
        elif call.new_body is not None or self._ledger_pool is not None:
            # The reader may hold back the stream's end (usage asked for by us), or the settle runs on
            # a thread, where the caller's next request could overtake it: settle, then end the answer.
            await response.write_eof(await self._off_loop(call.finish))
        else:
            try:
                await response.write_eof()
            finally:
                # Settled once the caller has its answer, off its latency; write_eof yields to the loop only to a
                # slow reader, so the caller cannot ask again before the settle is written (never less safe).
                call.finish()
        return response

    def _unreachable(self, exc: Exception) -> web.Response:
        reason = redact_text(f"{type(exc).__name__}: {exc}")
        warn(f"gateway: the upstream {self.shown_upstream} did not answer: {reason}")
        return _answer(
            SyntheticResponse.ark_error(
                502,
                "QuotawrapUpstreamUnavailable",
                "BadGateway",
                f"quotawrap's gateway could not reach {self.shown_upstream}: {reason}",
            )
        )
