"""Context caches: a context chat reads tokens its request does not carry.

``/context/chat/completions`` names a ``context_id``; the provider prepends the cached context
(billed as cached input) to the messages sent. An estimate from the request alone would miss
those tokens, so the guard remembers, per process, how large each context it saw created was
(``usage.prompt_tokens`` of ``/context/create``) and adds that to a context chat's reserve. A
context created elsewhere (another process, an earlier run) is unknown here: its chats reserve
their own messages only, and the settle still charges what the provider reports.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict

from ..core.usage import usage_from_body

TYPE_CHECKING = False
if TYPE_CHECKING:
    from .call import GuardedCall

__all__ = ["ContextCreated", "ContextSizes"]

_MAX_CONTEXTS = 1024


class ContextSizes:
    """Tokens of each context created in this process, by id; thread-safe and bounded."""

    def __init__(self) -> None:
        self._sizes: OrderedDict[str, int] = OrderedDict()
        self._lock = threading.Lock()

    def note(self, context_id: str, tokens: int) -> None:
        with self._lock:
            self._sizes[context_id] = tokens
            self._sizes.move_to_end(context_id)
            while len(self._sizes) > _MAX_CONTEXTS:
                self._sizes.popitem(last=False)

    def size(self, context_id: object) -> int:
        if not isinstance(context_id, str):
            return 0
        with self._lock:
            return self._sizes.get(context_id, 0)


class ContextCreated:
    """Follows a guarded context create: remembers the context's size, then settles as usual."""

    def __init__(self, sizes: ContextSizes) -> None:
        self._sizes = sizes

    def finish(self, call: GuardedCall, status: int, body: bytes, complete: bool) -> bool:
        if complete and 200 <= status < 300:
            try:
                data = json.loads(body)
            except (ValueError, UnicodeDecodeError):
                data = None
            usage = usage_from_body(body)
            if isinstance(data, dict) and isinstance(data.get("id"), str) and usage is not None:
                self._sizes.note(data["id"], usage.prompt_tokens)
        return False  # the create itself settles from its usage like any call
