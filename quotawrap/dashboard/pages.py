"""What the dashboard answers on each of its paths; the servers only carry the bytes.

The page polls ``data.json`` every :data:`REFRESH_S`; every client and every poll within
:data:`FRESH_S` of the last read shares one read of the store, so an open tab costs the store
a read every :data:`REFRESH_S` whatever the number of tabs.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from importlib.resources import files
from typing import Any

from ..books.status import current_status
from ..config.settings import Settings
from ..core.errors import QuotawrapError
from ..core.records import Record
from ..core.redact import redact_text, redact_url
from ..ledger import Ledger

__all__ = ["DASHBOARD_PATH", "FRESH_S", "REFRESH_S", "Answer", "Pages", "store_reader"]

#: Where the gateway serves the page: under its reserved prefix, which no upstream path can be.
DASHBOARD_PATH = "/_quotawrap/dashboard/"
REFRESH_S = 2.0
FRESH_S = 1.0

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

    def __init__(self, read: Callable[[], dict[str, Any]], *, fresh_s: float = FRESH_S) -> None:
        self._read = read
        self._fresh_s = fresh_s
        self._lock = threading.Lock()
        self._last: tuple[float, dict[str, Any]] | None = None

    def snapshot(self) -> dict[str, Any]:
        """The store's state, read anew unless the last read is younger than ``fresh_s``; raises what it raised."""
        with self._lock:
            if self._last is None or time.monotonic() - self._last[0] >= self._fresh_s:
                self._last = (time.monotonic(), self._read())
            return self._last[1]

    def answer(self, name: str) -> Answer:
        """The answer to ``GET <page root>/<name>``. Reads the store for ``data.json``: call it off an event loop."""
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
