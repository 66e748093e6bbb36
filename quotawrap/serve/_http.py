"""What the gateway changes on the way through, and nothing else. Pure: no I/O.

The gateway is transparent: the caller's method, path, query, headers (``Authorization``
included) and body go upstream, and the upstream's status, headers and body come back. Only
what belongs to one hop (RFC 9110 §7.6.1) or to quotawrap itself is dropped.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from ..core.tags import parse_tags

__all__ = [
    "ARK_BASE_URL",
    "HEALTH_PATH",
    "METRICS_PATH",
    "PROXY_VARIABLES",
    "RESERVED_PREFIX",
    "TAG_HEADER",
    "forwarded_request_headers",
    "forwarded_response_headers",
    "header_tags",
    "proxy_environment",
    "split_credentials",
    "upstream_url",
]

#: Where the gateway forwards when no ``--base-url`` names an upstream (the Ark SDK's default).
ARK_BASE_URL = "https://ark.cn-beijing.volces.com/api/v3"

#: quotawrap's own paths on the gateway (health, the dashboard): answered there, never forwarded upstream.
RESERVED_PREFIX = "/_quotawrap/"

#: Outside every provider's API: no upstream path can be shadowed by it.
HEALTH_PATH = RESERVED_PREFIX + "health"

#: Where Prometheus scrapes by default; a GET there is the gateway's own, never forwarded (no provider API
#: serves it under its base URL).
METRICS_PATH = "/metrics"

#: ``X-Quotawrap-Tag: user=alice, team=infra``: attribution per request, never sent upstream.
TAG_HEADER = "x-quotawrap-tag"

#: The variables ``--proxy`` sets in the child, and who reads each (docs/gateway.md lists them too).
PROXY_VARIABLES: tuple[tuple[str, str], ...] = (
    ("OPENAI_BASE_URL", "openai SDKs for Python (>= 1.0) and Node, the Agents SDK, most OpenAI-compatible tools"),
    ("OPENAI_API_BASE", "openai-python < 1.0, LangChain, LiteLLM"),
    ("ARK_BASE_URL", "Ark scripts and examples, quotawrap's demo agent"),
    ("VOLCENGINE_API_BASE", "LiteLLM's volcengine/ provider"),
)

_HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    }
)


def upstream_url(base: str, path: str, query: str) -> str:
    """The gateway's root stands for the upstream base: ``/chat/completions`` -> ``BASE/chat/completions``."""
    url = base.rstrip("/") + "/" + path.lstrip("/")
    return f"{url}?{query}" if query else url


def split_credentials(base: str) -> tuple[str, str | None]:
    """``http://user:pw@host/v3`` -> (``http://host/v3``, the ``Basic`` credential they stand for).

    The upstream client cannot send a URL's credentials beside the caller's own ``Authorization``
    (aiohttp refuses to combine them), and a URL that carries them must never be shown: the gateway
    keeps the base without them, and sends them only to a caller that brought no credential itself.
    """
    from base64 import b64encode
    from urllib.parse import unquote, urlsplit

    parts = urlsplit(base)
    if "@" not in parts.netloc:
        return base, None
    userinfo, _, host = parts.netloc.rpartition("@")
    user, _, password = userinfo.partition(":")
    credential = b64encode(f"{unquote(user)}:{unquote(password)}".encode()).decode("ascii")
    return parts._replace(netloc=host).geturl(), f"Basic {credential}"


def _connection_listed(headers: Sequence[tuple[str, str]]) -> set[str]:
    """Headers a ``Connection`` header names are hop-by-hop as well."""
    return {
        token.strip().lower()
        for name, value in headers
        if name.lower() == "connection"
        for token in value.split(",")
        if token.strip()
    }


def forwarded_request_headers(headers: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
    """The caller's headers as they go upstream: without hop-by-hop, Host, length and our tag header.

    Host and Content-Length are the upstream client's to write (another host; a body the guard may
    re-encode). Repeated headers stay repeated, in order.
    """
    pairs = list(headers)
    drop = _HOP_BY_HOP | _connection_listed(pairs) | {"host", "content-length", TAG_HEADER}
    return [(name, value) for name, value in pairs if name.lower() not in drop]


def forwarded_response_headers(headers: Iterable[tuple[str, str]], *, keep_length: bool) -> list[tuple[str, str]]:
    """The upstream's headers as they go back; Content-Length only when the body passes byte for byte."""
    pairs = list(headers)
    drop = _HOP_BY_HOP | _connection_listed(pairs)
    if not keep_length:
        drop = drop | {"content-length"}
    return [(name, value) for name, value in pairs if name.lower() not in drop]


def header_tags(values: Sequence[str]) -> dict[str, str]:
    """Tags from every ``X-Quotawrap-Tag`` header (comma-separated KEY=VALUE); ConfigError names a bad one."""
    entries = [part.strip() for value in values for part in value.split(",") if part.strip()]
    return parse_tags(entries)


def proxy_environment(gateway_url: str) -> dict[str, str]:
    """The child's variables that make SDKs of any language send their calls through the gateway."""
    return {name: gateway_url for name, _ in PROXY_VARIABLES}
