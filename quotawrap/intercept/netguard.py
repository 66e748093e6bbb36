"""The last line of defence: no connection to a guarded host that no HTTP seam has seen.

``socket.socket.connect``/``connect_ex`` are where every Python-level connection ends up
(``socket.create_connection``, http.client, httpcore, asyncio's ``sock_connect`` and so
``loop.create_connection``, aiohttp, anyio). A connection to an Ark host or a ``--base-url``
host:port made while no seam marks the context (:mod:`._scope`) carries requests quotawrap
cannot read, so it is refused with ``ConnectionRefusedError`` naming the code that made it,
or, under ``--allow-unguarded``, let through; both are recorded for the run's summary.

Addresses arrive resolved, so ``getaddrinfo`` is watched too: the addresses of a guarded name
join the guarded set when the program resolves it. Everything here is cheap on purpose: one
set lookup per connect (a port pre-filter first), one regex per name resolution.
"""

from __future__ import annotations

import errno
import os
import sys

from . import _scope

TYPE_CHECKING = False  # socket is imported by nearly every program: no typing, re or functools here
if TYPE_CHECKING:
    from collections.abc import Callable
    from types import ModuleType
    from typing import Any

__all__ = ["GuardedAddresses", "patch", "unpatch"]

_MARK = "_quotawrap_netguard"
_REGION_CHARS = frozenset("abcdefghijklmnopqrstuvwxyz0123456789-")
_ARK_PORTS = (443, 80)
# Frames of these modules are the plumbing below the code that asked for the connection.
_PLUMBING = ("socket", "ssl", "selectors", "asyncio", "concurrent", "threading", "contextlib", "quotawrap")


class GuardedAddresses:
    """The host:port pairs whose connections must come through a seam."""

    def __init__(self, base_urls: list[str]) -> None:
        self.pairs: set[tuple[str, int]] = set()
        self.names: dict[str, tuple[int, ...]] = {}
        for base in base_urls:
            host, port = _host_port(base)
            if host:
                self._add_name(host, (port,))
        # Ark's ports always: a program may connect to an Ark name without resolving it first.
        self.ports = {*_ARK_PORTS, *(port for _host, port in self.pairs)}

    def _add_name(self, host: str, ports: tuple[int, ...]) -> None:
        self.names[host] = tuple(sorted({*self.names.get(host, ()), *ports}))
        for port in ports:
            self.pairs.add((host, port))
        if host == "localhost":  # resolved by the hosts file, often without getaddrinfo being asked
            for address in ("127.0.0.1", "::1"):
                self.pairs.update((address, port) for port in ports)

    def ports_of(self, host: str) -> tuple[int, ...]:
        host = host.lower().rstrip(".")
        if host in self.names:
            return self.names[host]
        return _ARK_PORTS if _is_ark(host) else ()

    def learn(self, ports: tuple[int, ...], results: Any) -> None:
        """Addresses ``getaddrinfo`` gave for a guarded name are guarded too."""
        for result in results:
            sockaddr = result[4]
            if isinstance(sockaddr, tuple) and len(sockaddr) >= 2:
                for port in ports:
                    self.pairs.add((str(sockaddr[0]), port))
        self.ports.update(ports)

    def guarded(self, address: Any) -> tuple[str, int] | None:
        if not isinstance(address, tuple) or len(address) < 2:
            return None  # a Unix socket or a malformed address
        port = address[1]
        if port not in self.ports:
            return None
        host = str(address[0]).lower()
        if (host, port) in self.pairs or port in self.ports_of(host):
            return host, port
        return None


def _is_ark(host: str) -> bool:
    """endpoints.ARK_HOST without ``re``: ark[.region].(volces|bytepluses).com."""
    parts = host.split(".")
    if len(parts) not in (3, 4) or parts[0] != "ark" or parts[-1] != "com":
        return False
    if parts[-2] not in ("volces", "bytepluses"):
        return False
    return len(parts) == 3 or (bool(parts[1]) and set(parts[1]) <= _REGION_CHARS)


def _wraps(wrapper: Callable[..., Any], original: Callable[..., Any]) -> Callable[..., Any]:
    """functools.wraps, without importing functools at start-up: unpatch() needs __wrapped__."""
    wrapper.__wrapped__ = original  # type: ignore[attr-defined]
    wrapper.__name__ = getattr(original, "__name__", wrapper.__name__)
    wrapper.__doc__ = getattr(original, "__doc__", None)
    return wrapper


def _host_port(url: str) -> tuple[str, int]:
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(url)
        port = parts.port or (443 if parts.scheme.lower() == "https" else 80)
    except ValueError:
        return "", 0
    return (parts.hostname or "").lower(), port


def _who() -> str:
    """The module and function that asked for the connection, below the socket plumbing."""
    frame: Any = sys._getframe(2)
    while frame is not None:
        name = str(frame.f_globals.get("__name__", "?"))
        if not name.startswith(_PLUMBING):
            return f"{name}.{frame.f_code.co_name}"
        frame = frame.f_back
    return "unknown code"


def _record(target: str, stack: str, allowed: bool) -> None:
    run_dir = os.environ.get("QUOTAWRAP_RUN_DIR", "").split(os.pathsep)[0]  # the innermost run's
    if not run_dir:
        return
    import json  # only on the rare refused or let-through connection, never at start-up

    line = json.dumps({"pid": os.getpid(), "target": target, "stack": stack, "allowed": allowed}) + "\n"
    try:
        fd = os.open(
            os.path.join(run_dir, "connections.jsonl"),
            os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0),
            0o600,
        )
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)
    except OSError as exc:
        sys.stderr.write(f"quotawrap: could not record an unguarded connection to {target}: {exc}\n")


def _message(target: str, stack: str) -> str:
    return (
        f"quotawrap refused a connection to {target}, a guarded LLM endpoint, made by {stack} outside any"
        " HTTP client quotawrap guards (httpx, httpx2, requests, aiohttp, urllib3, urllib.request, http.client):"
        " what it sends could not be reserved against the caps. Use one of those clients, or pass"
        " --allow-unguarded (QUOTAWRAP_ALLOW_UNGUARDED=1) to let such connections through; they are counted"
        " in the run's summary."
    )


def _allowed() -> bool:
    # settings.parse_value's spelling of a true boolean, read here without importing settings:
    # this module loads with socket in every child, settings with the first guarded call.
    return os.environ.get("QUOTAWRAP_ALLOW_UNGUARDED", "").strip().lower() in {"1", "true", "yes", "on"}


def _check(guarded: GuardedAddresses, address: Any) -> str | None:
    """None to connect; else the refusal's message (already recorded)."""
    if _scope.current() is not None:
        return None
    pair = guarded.guarded(address)
    if pair is None:
        return None
    host, port = pair
    target = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    stack = _who()
    allow = _allowed()
    _record(target, stack, allow)
    if allow:
        sys.stderr.write(f"quotawrap: --allow-unguarded: {stack} connects to {target} UNGUARDED\n")
        return None
    return _message(target, stack)


def _make_connect(guarded: GuardedAddresses, original: Callable[..., Any]) -> Callable[..., Any]:
    def connect(self: Any, address: Any) -> Any:
        refusal = _check(guarded, address)
        if refusal is not None:
            raise ConnectionRefusedError(errno.ECONNREFUSED, refusal)
        return original(self, address)

    return _wraps(connect, original)


def _make_connect_ex(guarded: GuardedAddresses, original: Callable[..., Any]) -> Callable[..., Any]:
    def connect_ex(self: Any, address: Any) -> Any:
        refusal = _check(guarded, address)
        if refusal is not None:
            sys.stderr.write(refusal + "\n")  # connect_ex answers with a number only
            return errno.ECONNREFUSED
        return original(self, address)

    return _wraps(connect_ex, original)


def _make_getaddrinfo(guarded: GuardedAddresses, original: Callable[..., Any]) -> Callable[..., Any]:
    def getaddrinfo(host: Any, port: Any, *args: Any, **kwargs: Any) -> Any:
        results = original(host, port, *args, **kwargs)
        if isinstance(host, (str, bytes)):
            name = host.decode("ascii", "replace") if isinstance(host, bytes) else host
            ports = guarded.ports_of(name)
            if ports:
                guarded.learn(ports, results)
        return results

    return _wraps(getaddrinfo, original)


def _base_urls() -> list[str]:
    """QUOTAWRAP_BASE_URL as Settings.child_env writes it (a JSON list), or a comma list by hand."""
    raw = os.environ.get("QUOTAWRAP_BASE_URL", "")
    if raw.lstrip().startswith("["):
        import json

        try:
            return [str(item) for item in json.loads(raw)]
        except ValueError:
            return []
    return [part.strip() for part in raw.split(",") if part.strip()]


def patch(module: ModuleType, base_urls: list[str] | None = None) -> GuardedAddresses | None:
    """Guard ``socket`` connections. Idempotent."""
    if getattr(module, _MARK, None) is not None:
        return None
    guarded = GuardedAddresses(_base_urls() if base_urls is None else base_urls)
    sock = module.socket
    sock.connect = _make_connect(guarded, sock.connect)
    sock.connect_ex = _make_connect_ex(guarded, sock.connect_ex)
    setattr(module, "getaddrinfo", _make_getaddrinfo(guarded, module.getaddrinfo))  # noqa: B010
    setattr(module, _MARK, guarded)
    return guarded


def unpatch(module: ModuleType) -> None:
    if getattr(module, _MARK, None) is None:
        return
    sock = module.socket
    sock.connect = sock.connect.__wrapped__
    sock.connect_ex = sock.connect_ex.__wrapped__
    setattr(module, "getaddrinfo", module.getaddrinfo.__wrapped__)  # noqa: B010
    setattr(module, _MARK, None)
