"""What a guard remembers between requests of one process: refusals it gave, redirects it saw.

Retries of a refused request. A refusal is final for the caller (``x-should-retry: false``),
but some clients re-send it anyway: the Ark SDK's batch client retries every 429 until its
600 s timeout, litellm's ``num_retries`` and llama-index's retry decorator re-send any API
error. Re-checking each copy against the ledger wrote one blocked row per copy (7,074 rows in
4 s). So an identical request (same method, URL and body) from the same caller (thread and
asyncio task: a retry loop runs in its caller, while concurrent workers sending the same prompt
are separate calls) refused less than :data:`RETRY_WINDOW_S` ago gets the same answer from
memory, marked with its retry count, and writes nothing: the ledger keeps one blocked row per
refused request, however often it is retried. After the window the request is checked afresh
(a hold may have settled since).

Redirects. A guarded call answered with a redirect (307/308 keep the method and body) bills
nothing, but the client sends the same request on to the ``Location``, which may be outside
every guarded host. The guard remembers that target for :data:`REDIRECT_WINDOW_S`, so the
next hop is guarded as the call it continues instead of going out unguarded.
"""

from __future__ import annotations

import atexit
import dataclasses
import hashlib
import os
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable
from urllib.parse import urljoin, urlsplit

from ..core.records import Record
from ..support.log import warn

TYPE_CHECKING = False
if TYPE_CHECKING:
    from ..core.endpoints import Route

__all__ = [
    "REDIRECT_WINDOW_S",
    "RETRY_WINDOW_S",
    "RedirectMemory",
    "RetryMemory",
    "caller",
    "fingerprint",
    "unknown_path_message",
    "unreported_retries",
]

RETRY_WINDOW_S = 10.0
REDIRECT_WINDOW_S = 60.0
_MAX_ENTRIES = 256
_unreported: set[RetryMemory] = set()  # memories that answered retries and have yet to say how many


def unreported_retries() -> int:
    """Retry memories of this process that will report at exit: a guard nobody closed (tests check none is left)."""
    return len(_unreported)


def fingerprint(method: str, url: str, body: bytes | None, caller: str = "") -> str:
    digest = hashlib.sha256()
    for piece in (method.upper().encode(), url.encode(), body or b"", caller.encode()):
        digest.update(len(piece).to_bytes(8, "big"))
        digest.update(piece)
    return digest.hexdigest()


def caller() -> str:
    """Who is sending: the thread, and the asyncio task when one runs (asyncio is not imported for this)."""
    task = None
    asyncio = sys.modules.get("asyncio")
    if asyncio is not None:
        try:
            task = asyncio.current_task()
        except RuntimeError:  # no running event loop in this thread
            task = None
    return f"{threading.get_ident()}/{id(task) if task is not None else 0}"


def unknown_path_message(method: str, path: str) -> str:
    return (
        f"quotawrap refused {method.upper()} {path}: it is not an endpoint quotawrap knows how to estimate and"
        " settle, so it cannot guard its spend. If it bills nothing (or you accept its spend unguarded), allow"
        f" it with --allow-path {path} (QUOTAWRAP_ALLOW_PATH, repeatable; globs allowed)."
    )


def wrong_method_message(method: str, path: str) -> str:
    return (
        f"quotawrap refused {method.upper()} {path}: only POST is billed there (Ark answers other methods 405),"
        " so quotawrap answers it itself instead of sending a request it cannot guard. Send it as a POST."
    )


class _Refusal(Record):
    at: float
    answer: object  # the SyntheticResponse given
    retries: int = 0


class RetryMemory:
    """Refusals by request fingerprint, for :data:`RETRY_WINDOW_S`; thread-safe and bounded."""

    def __init__(self, window_s: float = RETRY_WINDOW_S) -> None:
        self.window_s = window_s
        self.retries = 0  # identical retries answered from memory, this process
        self._entries: OrderedDict[str, _Refusal] = OrderedDict()
        self._lock = threading.Lock()

    def __bool__(self) -> bool:
        """Whether any refusal is remembered (stale ones included): else no request needs its fingerprint."""
        return bool(self._entries)

    def remember(self, key: str, answer: object, now: float) -> None:
        with self._lock:
            self._entries[key] = _Refusal(now, answer)
            self._entries.move_to_end(key)
            while len(self._entries) > _MAX_ENTRIES:
                self._entries.popitem(last=False)

    def recall(self, key: str, now: float) -> tuple[object, int] | None:
        """The answer given to this request and how many retries of it there have been, if recent."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            if now - entry.at >= self.window_s:
                del self._entries[key]
                return None
            entry.retries += 1
            self.retries += 1
            return entry.answer, entry.retries

    def answer(self, key: str, now: float) -> object | None:
        """The answer to give a retry (a dataclass with ``headers``, marked with its retry count), if recent.

        The first retry in a process says so on stderr, and the process says at exit how many
        retries it answered this way: the ledger holds one row per refused request.
        """
        recalled = self.recall(key, now)
        if recalled is None:
            return None
        answer, retries = recalled
        if self.retries == 1:
            warn(
                "the program retries requests quotawrap refused; identical retries get the same answer"
                f" for {self.window_s:g} s and count as one blocked call"
            )
            _unreported.add(self)
            atexit.register(self._report)
        headers = (*getattr(answer, "headers", ()), ("x-quotawrap-retries", str(retries)))
        return dataclasses.replace(answer, headers=headers)  # type: ignore[type-var]

    def close(self) -> None:
        """Say now how many retries were answered, not at exit: the guard this memory served is done with."""
        if self in _unreported:
            atexit.unregister(self._report)
            self._report()

    def _report(self) -> None:
        _unreported.discard(self)
        warn(f"{self.retries:,} identical retries of refused requests were answered from memory (pid {os.getpid()})")


def _target(url: str) -> tuple[str, str, int | None, str] | None:
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        return None
    scheme = parts.scheme.lower()
    port = port or {"http": 80, "https": 443}.get(scheme)
    return scheme, (parts.hostname or "").lower(), port, parts.path.rstrip("/") or "/"


class RedirectMemory:
    """Where guarded calls were redirected to, for :data:`REDIRECT_WINDOW_S`; thread-safe and bounded."""

    def __init__(self, clock: Callable[[], float], window_s: float = REDIRECT_WINDOW_S) -> None:
        self._clock = clock
        self.window_s = window_s
        self._entries: OrderedDict[tuple[str, str, int | None, str], tuple[float, Route]] = OrderedDict()
        self._lock = threading.Lock()

    def note(self, from_url: str, location: str, route: Route) -> None:
        key = _target(urljoin(from_url, location.strip()))
        if key is None:
            return
        with self._lock:
            self._entries[key] = (self._clock() + self.window_s, route)
            self._entries.move_to_end(key)
            while len(self._entries) > _MAX_ENTRIES:
                self._entries.popitem(last=False)

    def route_for(self, method: str, url: str) -> Route | None:
        """The route of the call a request continues; None unless it re-sends a redirected POST."""
        if method.upper() != "POST" or not self._entries:
            return None
        key = _target(url)
        with self._lock:
            entry = self._entries.get(key) if key is not None else None
            if entry is None:
                return None
            if entry[0] < self._clock():
                del self._entries[key]  # type: ignore[arg-type]
                return None
            return entry[1]
