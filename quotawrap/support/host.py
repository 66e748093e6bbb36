"""This machine's name, as ``socket.gethostname()`` gives it, without importing :mod:`socket`.

The wrapper names its host in the run's record and the SQLite ledger in each hold; importing
``socket`` for that (its enums, ``selectors``) delayed every guarded command's child.
``gethostname(2)`` is ``uname(2)``'s node name on Linux and the BSDs.
"""

from __future__ import annotations

import os

__all__ = ["hostname"]


def hostname() -> str:
    if hasattr(os, "uname"):
        return os.uname().nodename
    import socket  # pragma: no cover - Windows

    return socket.gethostname()
