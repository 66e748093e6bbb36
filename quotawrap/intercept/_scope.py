"""Which HTTP stack is handling the current request, so a request is guarded once.

Seams sit at several layers (requests over urllib3 over http.client; httpx's client over its
transport; openai's aiohttp transport under httpx2). The outermost seam that sees a request
marks the context while it hands the request down; inner seams and the connection guard
read the mark. A contextvar, not a thread-local: asyncio tasks copy it, so a connection made
by a task of a guarded aiohttp or httpx call still carries the mark.
"""

from __future__ import annotations

from contextvars import ContextVar

TYPE_CHECKING = False
if TYPE_CHECKING:
    from contextvars import Token

    from ..settling.call import GuardedCall

__all__ = ["current", "enter", "leave", "reset_pending", "set_pending", "take_pending"]

# The name of the stack whose seam examined the request now being sent (None: no seam did).
_STACK: ContextVar[str | None] = ContextVar("quotawrap_stack", default=None)
# A guarded call whose response the http.client seam is to observe (urllib3's pool hands the
# request down to a connection it picks itself; the call rides along in the context).
_PENDING: ContextVar[GuardedCall | None] = ContextVar("quotawrap_pending", default=None)


def current() -> str | None:
    return _STACK.get()


def enter(stack: str) -> Token[str | None]:
    return _STACK.set(stack)


def leave(token: Token[str | None]) -> None:
    _STACK.reset(token)


def set_pending(call: GuardedCall | None) -> Token[GuardedCall | None]:
    return _PENDING.set(call)


def reset_pending(token: Token[GuardedCall | None]) -> None:
    _PENDING.reset(token)


def take_pending() -> GuardedCall | None:
    call = _PENDING.get()
    if call is not None:
        _PENDING.set(None)
    return call
