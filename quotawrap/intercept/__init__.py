"""Interception of HTTP clients: thin adapters over the one client-agnostic :class:`Guard`.

``install()`` registers post-import hooks, so a client library is patched when (and only
when) the program imports it; patching is idempotent and reversible (``unpatch``).

Seams, outermost first: httpx/httpx2 ``Client._send_single_request`` (then their transports),
requests ``HTTPAdapter.send``, aiohttp ``ClientSession._request``, urllib3
``HTTPConnectionPool.urlopen``, http.client ``HTTPConnection.request``. The first seam a request
meets marks the context (:mod:`._scope`); the ones below stand aside, so a call is reserved
once. Under all of them the connection guard (:mod:`.netguard`) refuses a connection to a
guarded host that no seam has seen.
"""

from __future__ import annotations

from ._active import get_guard, set_guard
from ._importhook import when_imported

TYPE_CHECKING = False  # importing typing itself would slow every child's start-up
if TYPE_CHECKING:
    from types import ModuleType

__all__ = ["get_guard", "install", "set_guard"]

_installed = False


def _patch_httpx_like(module: ModuleType) -> None:
    from .httpx_adapter import patch

    patch(module)


def _patch_requests(module: ModuleType) -> None:
    # requests/__init__ has imported requests.adapters by the time this runs.
    from .requests_adapter import patch

    patch(module)


def _patch_http_client(module: ModuleType) -> None:
    from .stdlib_adapter import patch_http_client

    patch_http_client(module)


def _patch_urllib3(module: ModuleType) -> None:
    from .stdlib_adapter import patch_urllib3

    patch_urllib3(module)


def _patch_aiohttp(module: ModuleType) -> None:
    from .aiohttp_adapter import patch

    patch(module)


def _guard_sockets(module: ModuleType) -> None:
    from .netguard import patch

    patch(module)


def install() -> None:
    """Patch every HTTP stack as soon as it is imported. Idempotent."""
    global _installed
    if _installed:
        return
    _installed = True
    when_imported("httpx", _patch_httpx_like)
    when_imported("httpx2", _patch_httpx_like)
    when_imported("requests", _patch_requests)
    when_imported("http.client", _patch_http_client)
    when_imported("urllib3", _patch_urllib3)
    when_imported("aiohttp", _patch_aiohttp)
    # _socket first: guarded as it loads, socket.socket is then defined as a subclass of the guarded type
    when_imported("_socket", _guard_sockets)
    when_imported("socket", _guard_sockets)
