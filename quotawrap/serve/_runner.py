"""Where a gateway runs: in the foreground until SIGTERM (``serve``), or on a thread for one run (``--proxy``)."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
from collections.abc import Callable, Coroutine
from typing import Any

from ..config.settings import Settings
from ..core.redact import redact_url
from ..ledger import CallPath
from ..support.log import warn
from ._gateway import Gateway
from ._http import PROXY_VARIABLES, proxy_environment, split_credentials

__all__ = ["GatewayThread", "run_in_foreground", "start_proxy"]


def run_in_foreground(gateway: Gateway, on_ready: Callable[[str], None]) -> None:
    """Serve until SIGTERM or SIGINT, then stop accepting and settle what is in flight."""

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stop.set)
        await gateway.start()
        on_ready(gateway.url)
        await _serve_until(gateway, stop)

    _run(main())


def _run(coroutine: Coroutine[Any, Any, None]) -> None:
    """uvloop when installed (the serve extra brings it): a faster loop costs each relayed call less."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(coroutine)
        return
    uvloop.run(coroutine)


class GatewayThread:
    """A gateway on its own event loop in a daemon thread, for the length of one wrapped run."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, name="quotawrap-gateway", daemon=True)

    def _run(self) -> None:
        async def main() -> None:
            self._loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()
            started = False
            try:
                await self.gateway.start()
                started = True
            except BaseException as exc:
                self._error = exc
            finally:
                self._ready.set()
            if started:
                await _serve_until(self.gateway, self._stop)

        _run(main())

    def start(self) -> str:
        """Start listening; the gateway's URL once it accepts connections. Raises what binding raised."""
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise self._error
        return self.gateway.url

    def stop(self) -> None:
        """Drain (calls in flight finish and settle, up to the gateway's drain timeout) and stop."""
        if self._loop is not None and self._stop is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(self.gateway.drain_timeout + 10)


async def _serve_until(gateway: Gateway, stop: asyncio.Event) -> None:
    try:
        await stop.wait()
    finally:
        await gateway.stop()


def start_proxy(settings: Settings, ledger: CallPath) -> tuple[GatewayThread, dict[str, str]]:
    """``--proxy``: a loopback gateway on a free port for this run, and the child's variables for it."""
    thread = GatewayThread(Gateway(settings, ledger, drain_timeout=settings.drain_timeout))
    url = thread.start()
    upstream, shown = thread.gateway.upstream, thread.gateway.shown_upstream
    for name, _ in PROXY_VARIABLES:
        previous = os.environ.get(name)
        if previous and split_credentials(previous)[0].rstrip("/") != upstream.rstrip("/"):
            previous = redact_url(previous)
            warn(
                f"{name}={previous} is replaced by the gateway, which forwards to {shown};"
                f" pass --base-url {previous} to forward there instead"
            )
    return thread, proxy_environment(url)
