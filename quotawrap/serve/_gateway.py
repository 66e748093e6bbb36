"""The gateway: an aiohttp server that drives the one :class:`Guard` exactly as the httpx adapter does.

Per request: ``Guard.begin`` reserves (or refuses with its synthetic answer), the request goes
upstream with the guard's header overrides and body, and every body chunk passes through
``GuardedCall.feed`` on its way to the caller as it arrives; ``finish`` settles at the end,
``close`` when the caller or the upstream goes away first, ``failed`` when nothing was sent.

The upstream client is aiohttp's, like the server: on a loaded 2-vCPU machine it costs the gateway
0.4 ms less per call than ``httpx.AsyncClient`` and carries 2.5 times its guarded requests per second
(bench/bench_gateway.py). No hook may run in this process (it would reserve the gateway's upstream
calls a second time): the CLI starts ``serve`` and ``--proxy`` without it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import socket
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar
from urllib.parse import urlsplit

import aiohttp
from aiohttp import web
from multidict import CIMultiDict
from yarl import URL

from .._errors import ConfigError
from .._log import warn
from ..guard import Guard
from ..guarded_call import GuardedCall
from ..ledger import Ledger
from ..ledger.base import run_key
from ..settings import Settings
from ..synthetic import SyntheticResponse
from ._http import (
    ARK_BASE_URL,
    HEALTH_PATH,
    TAG_HEADER,
    forwarded_request_headers,
    forwarded_response_headers,
    header_tags,
    upstream_url,
)

__all__ = ["Gateway"]

_MAX_BODY = 64 * 1024 * 1024  # images travel base64-encoded in the body
_GUARDS_KEPT = 256  # one Guard per distinct set of header tags
_NOT_SENT = (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError, aiohttp.InvalidURL)
_LEDGER_THREADS = 16
_T = TypeVar("_T")


class _Relayed(web.StreamResponse):
    """An upstream answer: its headers leave with its first bytes, in one write (a send costs ~0.1 ms here)."""

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


class Gateway:
    """One listening gateway: its settings, its ledger, its upstream and what it has in flight."""

    def __init__(
        self,
        settings: Settings,
        ledger: Ledger,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        drain_timeout: float = 30.0,
    ) -> None:
        self.settings = settings
        self.ledger = ledger
        self.upstream = settings.base_url[0] if settings.base_url else ARK_BASE_URL
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
        # stall the loop and the streams it relays; a local SQLite transaction (~0.1 ms) costs less
        # than the hop, and runs inline.
        remote = urlsplit(settings.store or "sqlite:").scheme not in ("", "sqlite")
        self._ledger_pool = ThreadPoolExecutor(_LEDGER_THREADS, "quotawrap-ledger") if remote else None
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
        app = web.Application(client_max_size=_MAX_BODY)
        app.router.add_get(HEALTH_PATH, self._health)
        app.router.add_route("*", "/{tail:.*}", self._forward)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=self.drain_timeout)
        await self._runner.setup()
        await web.SockSite(self._runner, sock).start()
        return self.url

    async def stop(self) -> None:
        """Stop accepting, let calls in flight finish (up to ``drain_timeout``) and settle, then close.

        A call still running at the deadline is cancelled, which closes its GuardedCall: the hold
        is charged whole (its outcome is unknown), never dropped.
        """
        self.draining = True
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._client is not None:
            await self._client.close()
            self._client = None
        if self._ledger_pool is not None:
            self._ledger_pool.shutdown(wait=True)

    async def _off_loop(self, fn: Callable[..., _T], *args: Any, abandon: Callable[[_T], None] | None = None) -> _T:
        """Run a step that touches the ledger: on a thread for a network ledger, else inline.

        ``abandon`` gets the step's result if the caller was cancelled (the drain deadline) while it ran.
        """
        if self._ledger_pool is None:
            return fn(*args)
        job = self._ledger_pool.submit(fn, *args)
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

        try:
            while True:
                finished, value = await self._off_loop(step, abandon=abandon)
                if finished:
                    return value  # type: ignore[no-any-return]
                await asyncio.sleep(value)
        finally:
            with contextlib.suppress(ValueError):  # still running on a ledger thread: it ends by itself
                steps.close()  # a cancelled wait leaves its place in line

    # -- handlers -----------------------------------------------------------------------------

    async def _health(self, request: web.Request) -> web.Response:
        """Liveness and readiness: the ledger answers, and the gateway is not draining."""
        body: dict[str, Any] = {
            "status": "ok",
            "upstream": self.upstream,
            "run_id": self.settings.run_id,
            "in_flight": self.in_flight,
            "uptime_s": round(time.time() - self.started_at, 3),
        }
        status = 200
        try:
            await self._off_loop(self.ledger.counters, [run_key(self._run_id)])  # one real read
        except Exception as exc:
            body.update(status="ledger unavailable", error=str(exc))
            status = 503
        if self.draining:
            body["status"] = "draining"
            status = 503
        return web.json_response(body, status=status)

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
        body = await request.read()
        url = upstream_url(self.upstream, request.rel_url.raw_path, request.rel_url.raw_query_string)
        headers = forwarded_request_headers(request.headers.items())
        try:
            tags = header_tags(request.headers.getall(TAG_HEADER, []))
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
                # After the caller has its answer, off its latency. write_eof yields to the loop
                # only when the caller reads slowly, so the caller cannot ask again before the
                # settle is written; another caller meanwhile sees the hold still open (never less safe).
                call.finish()
        return response

    def _unreachable(self, exc: Exception) -> web.Response:
        warn(f"gateway: the upstream {self.upstream} did not answer: {exc!r}")
        return _answer(
            SyntheticResponse.ark_error(
                502,
                "QuotawrapUpstreamUnavailable",
                "BadGateway",
                f"quotawrap's gateway could not reach {self.upstream}: {type(exc).__name__}: {exc}",
            )
        )
