"""Which guarded addresses a process holds TCP connections to, read from ``/proc`` (Linux).

The hook loads in Python processes only. A process of the run that is not Python (a Node agent,
``curl``, a Go tool started without ``--proxy``) sends calls quotawrap never sees, so the wrapper's
process watcher asks this module whether such a process holds a connection to Ark or to a
``--base-url`` host:port, and names it loudly (``--strict`` stops it). A connection is seen while it
is open: an LLM call holds one for as long as the answer takes, so real calls are caught; a call
that opens and closes between two of the watcher's polls on loopback may be missed. Everything here reads
files only; names are resolved off the start-up path (:meth:`GuardedPeers.resolve`), and nothing heavy
is imported until a process that is not Python holds a connection.
"""

from __future__ import annotations

import os
import threading

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Iterable

    from ..intercept.netguard import GuardedAddresses

__all__ = ["GuardedPeers", "open_peers", "parse_tcp_table"]

# The Ark hosts a program reaches without any --base-url; their addresses are learnt once by name.
ARK_HOSTS = ("ark.cn-beijing.volces.com", "ark.cn-shanghai.volces.com", "ark.ap-southeast.bytepluses.com")
_CONNECTING_OR_OPEN = {"01", "02"}  # ESTABLISHED, SYN_SENT


def _address(hex_address: str) -> tuple[str, int]:
    """One ``/proc/net/tcp{,6}`` address (``0100007F:1F90``) as (ip, port); v4-mapped v6 as v4."""
    import ipaddress  # read only once a process that is not Python holds a connection

    host_hex, _, port_hex = hex_address.partition(":")
    raw = bytes.fromhex(host_hex)
    # the kernel prints each 32-bit word in host byte order (little-endian on every Linux we run on)
    packed = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    ip = ipaddress.ip_address(packed)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return str(ip), int(port_hex, 16)


def parse_tcp_table(text: str) -> dict[int, tuple[str, int]]:
    """Pure: socket inode -> remote (ip, port) of the connections being opened or open in a TCP table."""
    peers: dict[int, tuple[str, int]] = {}
    for line in text.splitlines()[1:]:
        fields = line.split()
        if len(fields) < 10 or fields[3] not in _CONNECTING_OR_OPEN:
            continue
        try:
            peers[int(fields[9])] = _address(fields[2])
        except ValueError:
            continue
    return peers


def _socket_inodes(pid: int) -> set[int]:
    inodes: set[int] = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return inodes
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    return inodes


def open_peers(pid: int) -> list[tuple[str, int]]:
    """The remote (ip, port) of every TCP connection process ``pid`` holds now (none when unreadable)."""
    inodes = _socket_inodes(pid)
    if not inodes:
        return []
    found: list[tuple[str, int]] = []
    for table in ("tcp", "tcp6"):
        try:
            with open(f"/proc/{pid}/net/{table}", encoding="ascii", errors="replace") as handle:
                peers = parse_tcp_table(handle.read())
        except OSError:
            continue
        found.extend(peer for inode, peer in peers.items() if inode in inodes)
    return found


class GuardedPeers:
    """The guarded host:port pairs as addresses: literal ones at once, names once resolved."""

    def __init__(self, base_urls: Iterable[str]) -> None:
        self._base_urls = list(base_urls)
        self._built: GuardedAddresses | None = None  # built on first use: the wrapper makes this as its child starts
        self._lock = threading.RLock()

    @property
    def _addresses(self) -> GuardedAddresses:
        with self._lock:
            if self._built is None:
                from ..intercept.netguard import GuardedAddresses

                self._built = GuardedAddresses(self._base_urls)
            return self._built

    def resolve(self) -> None:
        """Learn the addresses of the guarded names (slow, may fail offline: call it off the start-up path)."""
        import socket

        for name in [name for name in (*self._addresses.names, *ARK_HOSTS) if not _is_literal(name)]:
            ports = self._addresses.ports_of(name)
            try:
                results = socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)
            except (OSError, UnicodeError):
                continue
            with self._lock:
                self._addresses.learn(ports, results)

    def guarded(self, peer: tuple[str, int]) -> bool:
        with self._lock:
            return peer in self._addresses.pairs


def _is_literal(host: str) -> bool:
    import ipaddress

    try:
        ipaddress.ip_address(host)
    except ValueError:
        return host == "localhost"  # GuardedAddresses adds its loopback addresses itself
    return True
