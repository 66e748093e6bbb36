"""What the injected ``sitecustomize`` calls in every child interpreter.

It only registers post-import hooks: the guard, the ledger and the tokenizers load when the
program first imports httpx, httpx2 or requests, so a child that makes no HTTP calls pays
almost nothing at start-up.
"""

from __future__ import annotations

import os
import sys

__all__ = ["RUN_ID_VARIABLE", "initialize", "loaded"]

RUN_ID_VARIABLE = "QUOTAWRAP_RUN_ID"
loaded = False


def initialize(*, swallow_exceptions: bool = True) -> None:
    """Install interception if this interpreter was launched by quotawrap. Never raises by default."""
    global loaded
    if not os.environ.get(RUN_ID_VARIABLE):
        return
    try:
        from .intercept import install

        install()
        loaded = True
    except Exception as exc:
        if not swallow_exceptions:
            raise
        sys.stderr.write(f"quotawrap: could not install interception in this process: {exc!r}\n")
