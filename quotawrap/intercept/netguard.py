"""The last line of defence: no connection to a guarded host that no HTTP seam has seen.

Every Python-level connection ends in a method of the C socket type ``_socket.socket``:
``connect``/``connect_ex`` (``socket.create_connection``, http.client, httpcore, asyncio's
``sock_connect`` and so ``loop.create_connection``, aiohttp, anyio), or ``sendto``/``sendmsg`` with
an address (TCP fast open, datagrams). The C type cannot be patched, so the name ``_socket.socket``
is bound to a guarded subclass as ``_socket`` loads, and ``socket.socket`` is defined on top of it:
``_socket.socket()``, ``_socket.socket.connect(s, addr)``, ``dup()``, ``fromfd()`` all pass the
guard. A connection to an Ark host or a ``--base-url`` host:port made while no seam marks the
context (:mod:`._scope`) carries requests quotawrap cannot read, so it is refused with
``ConnectionRefusedError`` naming the code that made it, or, under ``--allow-unguarded``, let
through; both are recorded for the run's summary. Out of reach: the C type's methods fetched from
``__mro__`` and called unbound, ``ctypes`` calling libc, and programs that are not Python (those
the wrapper watches through ``/proc``, :mod:`quotawrap.wrapper.sockets`).

Addresses arrive resolved, so the resolvers are watched too: the addresses of a guarded name join
the guarded set when the program resolves it, and one address is recognised under every spelling
the kernel accepts (``::ffff:127.0.0.1``, ``127.1``, bytes, the unspecified address). Everything
here is cheap on purpose: one set lookup per connect (a port pre-filter first), one split per name
resolution.
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
        addresses = {host}
        canonical = _canonical(host)
        if canonical is not None:
            addresses.add(canonical)
        if host == "localhost" or canonical in _ANY:  # resolved by the hosts file, often without getaddrinfo
            addresses.update(_LOOPBACK)
        self.pairs.update((address, port) for address in addresses for port in ports)

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
                self.learn_address(ports, str(sockaddr[0]))

    def learn_address(self, ports: tuple[int, ...], address: str) -> None:
        canonical = _canonical(address)
        for port in ports:
            self.pairs.add((address, port))
            if canonical is not None:
                self.pairs.add((canonical, port))
        self.ports.update(ports)

    def guarded(self, address: Any, sock: Any = None) -> tuple[str, int] | None:
        """The guarded (host, port) a connection to ``address`` (by ``sock``, if known) would reach, or None.

        The kernel reaches one address under many spellings (``::ffff:127.0.0.1``, ``127.1``,
        ``b"127.0.0.1"``, ``0.0.0.0``, a name the C library resolves itself): each is brought to the
        form ``getaddrinfo`` prints before it is looked up, and a name that is not a guarded one is
        resolved as the kernel's caller would resolve it.
        """
        if not isinstance(address, tuple) or len(address) < 2:
            return None  # a Unix socket or a malformed address
        port = address[1]
        if port not in self.ports:
            return None
        raw = address[0]
        host = (raw.decode("latin-1") if isinstance(raw, (bytes, bytearray)) else str(raw)).lower()
        if (host, port) in self.pairs or port in self.ports_of(host):
            return host, port
        canonical = _canonical(host)
        if canonical is None:
            return self._resolved(host, port, _family(sock))
        for candidate in _LOOPBACK if canonical in _ANY else (canonical,):
            if (candidate, port) in self.pairs:
                return candidate, port
        return None

    def _resolved(self, host: str, port: int, family: int) -> tuple[str, int] | None:
        """A name passed to connect() itself: its addresses, as the C library will resolve them."""
        import _socket

        try:
            results = _socket.getaddrinfo(host, port, family, _socket.SOCK_STREAM)
        except (OSError, UnicodeError, ValueError):
            return None  # the connect will fail the same way
        for result in results:
            canonical = _canonical(str(result[4][0]))
            if canonical is not None and (canonical, port) in self.pairs:
                return canonical, port
        return None


_ANY = ("0.0.0.0", "::")  # a connect to the unspecified address reaches the loopback interface
_LOOPBACK = ("127.0.0.1", "::1")
_V4_MAPPED = b"\0" * 10 + b"\xff\xff"


def _canonical(host: str) -> str | None:
    """A numeric address in ``getaddrinfo``'s spelling (a v4-mapped v6 address as v4); None for a name."""
    import _socket

    if host == "":
        return "0.0.0.0"  # Python's spelling of INADDR_ANY
    if ":" in host:
        try:
            packed = _socket.inet_pton(_socket.AF_INET6, host.partition("%")[0])
        except (OSError, ValueError):
            return None
        if packed[:12] == _V4_MAPPED:
            return _socket.inet_ntop(_socket.AF_INET, packed[12:])
        return _socket.inet_ntop(_socket.AF_INET6, packed)
    try:  # inet_aton reads "127.1", "0x7f000001" and "2130706433" as the C library's resolver does
        return _socket.inet_ntoa(_socket.inet_aton(host))
    except (OSError, ValueError):
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
    wrapper.__qualname__ = getattr(original, "__qualname__", wrapper.__qualname__)
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


def _check(guarded: GuardedAddresses, address: Any, sock: Any = None) -> str | None:
    """None to connect; else the refusal's message (already recorded)."""
    if _scope.current() is not None:
        return None
    pair = guarded.guarded(address, sock)
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


def _family(sock: Any) -> int:
    try:
        return int(sock.family) if sock is not None else 0
    except (AttributeError, TypeError, ValueError, OSError):
        return 0


# What the installed methods and resolvers check; None once unpatched (a socket class made while the
# guard was on keeps its guarded base, which then passes every call through).
_active: GuardedAddresses | None = None


def _refuse(sock: Any, address: Any) -> str | None:
    guarded = _active
    if guarded is None or not isinstance(address, tuple) or len(address) < 2 or address[1] not in guarded.ports:
        return None  # the port pre-filter first: sendto on a datagram socket may run for every packet
    return _check(guarded, address, sock)


def _guarded_methods(c_type: type) -> dict[str, Callable[..., Any]]:
    """connect, connect_ex, sendto and sendmsg of the C socket type, each checking its address first.

    sendto and sendmsg take an address too: with ``MSG_FASTOPEN`` they open a TCP connection and send
    in one step, and on a datagram socket they are how HTTP/3 would reach a guarded port.
    """
    c_connect, c_connect_ex = c_type.connect, c_type.connect_ex  # type: ignore[attr-defined]
    c_sendto, c_sendmsg = c_type.sendto, getattr(c_type, "sendmsg", None)  # type: ignore[attr-defined]

    def connect(self: Any, address: Any) -> Any:
        refusal = _refuse(self, address)
        if refusal is not None:
            raise ConnectionRefusedError(errno.ECONNREFUSED, refusal)
        return c_connect(self, address)

    def connect_ex(self: Any, address: Any) -> Any:
        refusal = _refuse(self, address)
        if refusal is not None:
            sys.stderr.write(refusal + "\n")  # connect_ex answers with a number only
            return errno.ECONNREFUSED
        return c_connect_ex(self, address)

    def sendto(self: Any, data: Any, *flags_address: Any) -> Any:  # sendto(data[, flags], address)
        refusal = _refuse(self, flags_address[-1]) if flags_address else None
        if refusal is not None:
            raise ConnectionRefusedError(errno.ECONNREFUSED, refusal)
        return c_sendto(self, data, *flags_address)

    methods: dict[str, Callable[..., Any]] = {"connect": connect, "connect_ex": connect_ex, "sendto": sendto}
    if c_sendmsg is not None:

        def sendmsg(self: Any, buffers: Any, *rest: Any) -> Any:  # sendmsg(buffers[, ancdata[, flags[, address]]])
            refusal = _refuse(self, rest[2]) if len(rest) >= 3 else None
            if refusal is not None:
                raise ConnectionRefusedError(errno.ECONNREFUSED, refusal)
            return c_sendmsg(self, buffers, *rest)

        methods["sendmsg"] = sendmsg
    for name, method in methods.items():
        _wraps(method, getattr(c_type, name))
        method.__qualname__ = f"socket.{name}"
    return methods


class _LikeTheCType(type):
    """``isinstance(sock, _socket.socket)`` stays true for sockets of classes made before the guard."""

    def __instancecheck__(cls, instance: Any) -> bool:
        c_type = cls.__dict__.get("_quotawrap_stands_for")
        return isinstance(instance, c_type) if c_type is not None else type.__instancecheck__(cls, instance)

    def __subclasscheck__(cls, subclass: Any) -> bool:
        c_type = cls.__dict__.get("_quotawrap_stands_for")
        return issubclass(subclass, c_type) if c_type is not None else type.__subclasscheck__(cls, subclass)


def _guarded_type(c_type: type) -> type:
    """A subclass of the C socket type whose connecting methods are guarded.

    The C type cannot be patched, so the guard replaces the *name* ``_socket.socket`` with this class.
    When ``_socket`` is guarded as it is imported (the hook's usual case), ``socket.socket`` is then
    defined as a subclass of it and every socket made afterwards, ``dup()``, ``fromfd()`` and
    ``socket(fileno=...)`` included, inherits the guard. A class that already subclasses the C type
    gets the same methods set on it instead (:func:`_guard_subclasses`).
    """
    existing = [sub for sub in _subclasses(c_type) if not sub.__dict__.get("_quotawrap_stands_for")]
    metaclass = _LikeTheCType if existing else type
    namespace: dict[str, Any] = {
        **_guarded_methods(c_type),
        "__slots__": (),
        "__module__": c_type.__module__,
        "__qualname__": c_type.__qualname__,
        "__doc__": c_type.__doc__,
        "_quotawrap_stands_for": c_type,
    }
    return metaclass(c_type.__name__, (c_type,), namespace)


def _subclasses(c_type: type) -> list[type]:
    return list(c_type.__subclasses__())


class _State:
    """What the guard replaced in ``_socket`` and ``socket``, to put back on unpatch."""

    def __init__(self, c_type: type, guarded_type: type) -> None:
        self.c_type = c_type
        self.guarded_type = guarded_type
        self.replaced: list[tuple[Any, str, Any]] = []  # (owner, name, what was there before)
        self.added: list[tuple[type, str]] = []


def _replace(state: _State, owner: Any, name: str, value: Any) -> None:
    state.replaced.append((owner, name, getattr(owner, name)))
    setattr(owner, name, value)


def _guard_subclasses(state: _State) -> None:
    """Classes that subclassed the C type before the guard (``socket.socket`` when socket was already imported)."""
    methods = {
        name: state.guarded_type.__dict__[name] for name in _GUARDED_METHODS if name in state.guarded_type.__dict__
    }
    for sub in _subclasses(state.c_type):
        if sub is state.guarded_type or sub.__dict__.get("_quotawrap_stands_for") is not None:
            continue
        for name, method in methods.items():
            if name not in sub.__dict__:  # a class's own override calls the name, or super(), on its own
                setattr(sub, name, method)
                state.added.append((sub, name))


def _make_resolver(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    """getaddrinfo, gethostbyname, gethostbyname_ex: the addresses of a guarded name join the guarded set."""

    def resolve(host: Any, *args: Any, **kwargs: Any) -> Any:
        results = original(host, *args, **kwargs)
        guarded = _active
        if guarded is not None and isinstance(host, (str, bytes)):
            ports = guarded.ports_of(host.decode("ascii", "replace") if isinstance(host, bytes) else host)
            if ports:
                if name == "getaddrinfo":
                    guarded.learn(ports, results)
                else:
                    for address in [results] if name == "gethostbyname" else results[2]:
                        guarded.learn_address(ports, str(address))
        return results

    return _wraps(resolve, original)


_GUARDED_METHODS = ("connect", "connect_ex", "sendto", "sendmsg")
_RESOLVERS = ("getaddrinfo", "gethostbyname", "gethostbyname_ex")


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
    """Guard connections made through ``_socket`` (given it or ``socket``). Idempotent.

    The hook calls it as ``_socket`` is imported and again for ``socket``; the second call finds the
    guard on and only re-binds the names ``socket`` copied (a guard installed after ``socket`` was
    imported is the same call).
    """
    global _active
    c_module = getattr(module, "_socket", module)  # socket.py keeps the C module as socket._socket
    state: _State | None = getattr(c_module, _MARK, None)
    if state is None:
        state = _State(c_module.socket, _guarded_type(c_module.socket))
        setattr(c_module, _MARK, state)
    fresh = _active is None
    if fresh:
        _active = GuardedAddresses(_base_urls() if base_urls is None else base_urls)
        for name in ("socket", "SocketType"):
            _replace(state, c_module, name, state.guarded_type)
        for name in _RESOLVERS:
            _replace(state, c_module, name, _make_resolver(name, getattr(c_module, name)))
        _guard_subclasses(state)
    if module is not c_module:
        # socket copied these from _socket before the guard when socket came first
        for name in ("SocketType", "gethostbyname", "gethostbyname_ex"):
            if getattr(module, name, None) is next((old for owner, n, old in state.replaced if n == name), None):
                _replace(state, module, name, getattr(c_module, name))
    return _active if fresh else None


def unpatch(module: ModuleType) -> None:
    global _active
    c_module = getattr(module, "_socket", module)
    state: _State | None = getattr(c_module, _MARK, None)
    if state is None or _active is None:
        return
    _active = None
    for owner, name, old in reversed(state.replaced):
        setattr(owner, name, old)
    for sub, name in state.added:
        delattr(sub, name)
    state.replaced.clear()
    state.added.clear()
