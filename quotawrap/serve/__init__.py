"""A local guarded gateway: any language's LLM calls through the same Guard and ledger.

``quotawrap serve`` runs one as a service (loopback by default); ``quotawrap --proxy -- CMD``
runs one for the length of a run and points the child's SDKs at it. Needs the ``serve`` extra
(aiohttp); see docs/gateway.md.
"""

from __future__ import annotations

import os
import sys

from ._http import ARK_BASE_URL, HEALTH_PATH, PROXY_VARIABLES, TAG_HEADER, proxy_environment

__all__ = [
    "ARK_BASE_URL",
    "HEALTH_PATH",
    "MISSING_EXTRA",
    "PROXY_VARIABLES",
    "TAG_HEADER",
    "proxy_environment",
    "without_hook",
]

MISSING_EXTRA = "the gateway needs aiohttp: pip install 'quotawrap[serve]'"


def without_hook() -> None:
    """A gateway reserves its calls itself: a hook loaded from an outer ``quotawrap`` would reserve its
    upstream calls again. Run this same command anew without the variable that loads the hook."""
    from .. import bootstrap

    if not bootstrap.loaded:
        return
    env = {name: value for name, value in os.environ.items() if name != bootstrap.RUN_ID_VARIABLE}
    os.execve(sys.executable, [sys.executable, "-m", "quotawrap", *sys.argv[1:]], env)
