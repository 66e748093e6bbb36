"""``quotawrap dashboard``: the page on a small standard-library HTTP server (no extra to install).

One thread per connection (``ThreadingHTTPServer``): a poll that reads the store never holds up
another tab's script. Only GET and HEAD are answered.
"""

from __future__ import annotations

import contextlib
import signal
import socket
import sys
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import FrameType
from urllib.parse import urlsplit

from ..core.redact import redact_text
from ..support.log import warn
from .pages import LOOPBACK, Answer, Pages, addressed_here

__all__ = ["DashboardServer", "warn_if_exposed"]


def warn_if_exposed(what: str, host: str, *, reach: str = "reads the store's figures") -> None:
    """One line when a listener is told to bind beyond this machine, saying what a stranger who reaches it can do."""
    if host not in LOOPBACK:
        warn(f"{what}: listening on {host}, not loopback: whoever reaches it {reach}")


class _Handler(BaseHTTPRequestHandler):
    server: DashboardServer
    server_version = "quotawrap-dashboard"
    sys_version = ""  # the Python version is nobody's business

    def do_GET(self) -> None:
        self._send(self._answer(), body=True)

    def do_HEAD(self) -> None:
        self._send(self._answer(), body=False)

    def _answer(self) -> Answer:
        pages, host = self.server.pages, self.headers.get("Host")
        if not addressed_here(host, str(self.server.server_address[0])):
            return pages.refused(host)
        return pages.answer(urlsplit(self.path).path.lstrip("/"))

    def _send(self, answer: Answer, *, body: bool) -> None:
        self.send_response(answer.status)
        self.send_header("Content-Type", answer.content_type)
        self.send_header("Content-Length", str(len(answer.body)))
        for name, value in answer.headers:
            self.send_header(name, value)
        self.end_headers()
        if body:
            self.wfile.write(answer.body)

    def log_message(self, format: str, *args: object) -> None:
        """Quiet: a tab polls every two seconds, and each poll would be a line."""


class DashboardServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, pages: Pages, host: str, port: int) -> None:
        if ":" in host:
            self.address_family = socket.AF_INET6
        super().__init__((host, port), _Handler)
        self.pages = pages

    def handle_error(self, request: object, client_address: object) -> None:
        """One line, not the standard library's traceback: a reader that went away, or a bug to report."""
        exc = sys.exc_info()[1]
        if not isinstance(exc, (BrokenPipeError, ConnectionResetError)):
            warn(f"dashboard: {redact_text(f'{type(exc).__name__}: {exc}')[:500]}")

    @property
    def url(self) -> str:
        host, port = str(self.server_address[0]), int(self.server_address[1])
        shown = f"[{host}]" if ":" in host else host
        return f"http://{shown}:{port}/"

    def serve_until_stopped(self, on_ready: Callable[[str], None]) -> None:
        """Serve until SIGTERM or Ctrl-C."""

        def stop(_signum: int, _frame: FrameType | None) -> None:
            raise KeyboardInterrupt

        signal.signal(signal.SIGTERM, stop)
        with contextlib.suppress(KeyboardInterrupt):  # a signal may come before serving starts, too
            on_ready(self.url)
            self.serve_forever()
        self.server_close()
