"""What the dashboard answers on each of its paths; the servers only carry the bytes.

The page polls ``data.json`` every :data:`REFRESH_S`; every client and every poll within
:data:`FRESH_S` of the last read shares one read of the store, so an open tab costs the store
a read every :data:`REFRESH_S` whatever the number of tabs.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Mapping
from importlib.resources import files
from typing import Any

from ..books.status import current_status
from ..config.settings import Settings
from ..core.errors import QuotawrapError
from ..core.records import Record
from ..core.redact import redact_text, redact_url
from ..ledger import Ledger

__all__ = ["DASHBOARD_PATH", "FRESH_S", "LOOPBACK", "REFRESH_S", "Answer", "Pages", "addressed_here", "store_reader"]

#: Where the gateway serves the page: under its reserved prefix, which no upstream path can be.
DASHBOARD_PATH = "/_quotawrap/dashboard/"
REFRESH_S = 2.0
FRESH_S = 1.0
LOOPBACK = ("127.0.0.1", "::1", "localhost")

_ASSETS = {
    "": ("index.html", "text/html; charset=utf-8"),
    "index.html": ("index.html", "text/html; charset=utf-8"),
    "dashboard.js": ("dashboard.js", "text/javascript; charset=utf-8"),
    "dashboard.css": ("dashboard.css", "text/css; charset=utf-8"),
    "icon.svg": ("icon.svg", "image/svg+xml"),
}
# The page runs only its own script and style, and is never framed by another site.
_HEADERS = (
    (
        "Content-Security-Policy",
        "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self';"
        " frame-ancestors 'none'",
    ),
    ("X-Content-Type-Options", "nosniff"),
    ("Referrer-Policy", "no-referrer"),
    ("Cache-Control", "no-store"),
)


def addressed_here(host_header: str | None, bound: str) -> bool:
    """Whether a request to a listener bound to ``bound`` names this machine in its Host header.

    A page of another site can point its own domain name at 127.0.0.1 (DNS rebinding) and read a loopback
    page as its own; its requests still carry that name. A listener bound beyond loopback was asked to be
    reached by other names, and answers them all."""
    if bound not in LOOPBACK or not host_header:
        return True  # browsers always send Host; a client that sends none is not a page of another site
    if host_header.startswith("["):  # an IPv6 address, then maybe :port
        address, _, port = host_header[1:].partition("]")
        name = address if not port or port.startswith(":") else host_header
    else:
        name = host_header.partition(":")[0]
    return name.lower() in LOOPBACK


class Answer(Record, frozen=True):
    status: int
    content_type: str
    body: bytes
    headers: tuple[tuple[str, str], ...] = _HEADERS


def store_reader(ledger: Ledger, settings: Settings, events_dir: str | None) -> Callable[[], dict[str, Any]]:
    """A read of the store as ``status --json`` makes it: on the ledger's clock, dead runs' holds charged first."""

    def read() -> dict[str, Any]:
        snapshot = current_status(ledger, settings, events_dir=events_dir)
        return {"store": redact_url(ledger.url), "refresh_s": REFRESH_S, **snapshot}

    return read


class Pages:
    """The dashboard's answers; ``read`` is the store read behind ``data.json``, shared as described above."""

    def __init__(
        self,
        read: Callable[[], dict[str, Any]],
        *,
        fresh_s: float = FRESH_S,
        extra: Mapping[str, Callable[[], tuple[str, bytes]]] | None = None,
    ) -> None:
        """``extra``: more paths under the page root, each answered 200 with what its function returns
        (``/metrics`` on ``quotawrap dashboard``)."""
        self._read = read
        self._extra = dict(extra or {})
        self._fresh_s = fresh_s
        self._lock = threading.Lock()
        self._last: tuple[float, dict[str, Any]] | None = None

    def snapshot(self) -> dict[str, Any]:
        """The store's state, read anew unless the last read is younger than ``fresh_s``; raises what it raised."""
        with self._lock:
            if self._last is None or time.monotonic() - self._last[0] >= self._fresh_s:
                self._last = (time.monotonic(), self._read())
            return self._last[1]

    def refused(self, host_header: str | None) -> Answer:
        """The answer to a request addressed to another name than this machine's (see ``addressed_here``)."""
        text = f"quotawrap's dashboard answers requests addressed to {', '.join(LOOPBACK)}, not {host_header}\n"
        return Answer(403, "text/plain; charset=utf-8", text.encode())

    def answer(self, name: str) -> Answer:
        """The answer to ``GET <page root>/<name>``. Reads the store for ``data.json``: call it off an event loop."""
        if name in self._extra:
            content_type, body = self._extra[name]()
            return Answer(200, content_type, body)
        if name == "data.json":
            try:
                body = json.dumps(self.snapshot(), separators=(",", ":")).encode()
            except QuotawrapError as exc:
                error = {"error": redact_text(str(exc))}
                return Answer(503, "application/json", json.dumps(error).encode())
            return Answer(200, "application/json", body)
        asset = _ASSETS.get(name)
        if asset is None:
            return Answer(404, "text/plain; charset=utf-8", b"not a page of quotawrap's dashboard\n")
        filename, content_type = asset
        return Answer(200, content_type, files(__package__).joinpath("assets", filename).read_bytes())
