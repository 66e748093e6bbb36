"""A local guarded gateway: any language's LLM calls through the same Guard and ledger.

``quotawrap serve`` runs one as a service (loopback by default); ``quotawrap --proxy -- CMD``
runs one for the length of a run and points the child's SDKs at it. Needs the ``serve`` extra
(aiohttp); see docs/gateway.md.
"""

from __future__ import annotations

from ._http import ARK_BASE_URL, HEALTH_PATH, PROXY_VARIABLES, TAG_HEADER, proxy_environment

__all__ = [
    "ARK_BASE_URL",
    "HEALTH_PATH",
    "MISSING_EXTRA",
    "PROXY_VARIABLES",
    "TAG_HEADER",
    "proxy_environment",
]

MISSING_EXTRA = "the gateway needs aiohttp: pip install 'quotawrap[serve]'"
