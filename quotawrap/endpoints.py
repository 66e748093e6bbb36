"""Which requests are guarded, and what they ask for. Pure: no I/O."""

from __future__ import annotations

import fnmatch
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import SplitResult, urlsplit

from .estimate import Kind

__all__ = [
    "ARK_HOST",
    "classify",
    "model_matches",
    "parse_json_body",
    "stream_requested",
    "wants_usage",
    "with_usage_requested",
]

# VolcEngine Ark in every region (ark.cn-beijing.volces.com, ...) and BytePlus ModelArk.
ARK_HOST = re.compile(r"^ark(?:\.[a-z0-9-]+)?\.(?:volces|bytepluses)\.com$")

_DEFAULT_PORTS = {"http": 80, "https": 443}

# Token-billed paths, longest suffix first; /responses/{id} and friends are reads, not billed.
_BILLED_SUFFIXES: tuple[tuple[str, Kind], ...] = (
    ("/bots/chat/completions", "chat"),
    ("/context/chat/completions", "chat"),
    ("/chat/completions", "chat"),
    ("/embeddings/multimodal", "embeddings"),
    ("/embeddings", "embeddings"),
    ("/responses", "responses"),
    ("/completions", "completions"),
)


def classify(method: str, url: str, base_urls: Sequence[str] = ()) -> Kind | None:
    """The kind of a token-billed call to a guarded endpoint, or None to pass it through."""
    if method.upper() != "POST":
        return None
    parts = urlsplit(url)
    host = (parts.hostname or "").lower()
    guarded = bool(ARK_HOST.match(host)) or any(_under(url, base) for base in base_urls)
    if not guarded:
        return None
    path = parts.path.rstrip("/")
    for suffix, kind in _BILLED_SUFFIXES:
        if path.endswith(suffix):
            return kind
    return None


def _under(url: str, base: str) -> bool:
    """Same origin and a path below the base's, compared by parts: clients spell URLs differently
    (httpx lower-cases the host and drops a default port, requests keeps both as given)."""
    target, prefix = urlsplit(url), urlsplit(base)
    if _origin(target) is None or _origin(target) != _origin(prefix):
        return False
    root = prefix.path.rstrip("/")
    return target.path == root or target.path.startswith(root + "/")


def _origin(parts: SplitResult) -> tuple[str, str, int | None] | None:
    try:
        port = parts.port
    except ValueError:  # a port that is not a number: no origin to compare
        return None
    scheme = parts.scheme.lower()
    return scheme, (parts.hostname or "").lower(), port or _DEFAULT_PORTS.get(scheme)


def model_matches(model: str, patterns: Sequence[str]) -> bool:
    """Exact id, prefix or glob; no patterns means every model."""
    if not patterns:
        return True
    for pattern in patterns:
        if any(ch in pattern for ch in "*?["):
            if fnmatch.fnmatchcase(model, pattern):
                return True
        elif model.startswith(pattern):
            return True
    return False


def parse_json_body(body: bytes | None) -> dict[str, Any]:
    """The request's JSON object; ``ValueError`` with a reason when it is not one."""
    if not body:
        raise ValueError("empty request body")
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"request body is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError("request body is not a JSON object")
    return data


def stream_requested(body: Mapping[str, Any]) -> bool:
    return body.get("stream") is True


def wants_usage(body: Mapping[str, Any]) -> bool:
    """Whether a chat/completions stream will carry usage without our help."""
    options = body.get("stream_options")
    if not isinstance(options, Mapping):
        return False
    return bool(options.get("include_usage")) or bool(options.get("chunk_include_usage"))


def with_usage_requested(body: Mapping[str, Any]) -> bytes:
    """The request body re-encoded with ``stream_options.include_usage`` switched on."""
    existing = body.get("stream_options")
    options = dict(existing) if isinstance(existing, Mapping) else {}
    options["include_usage"] = True
    return json.dumps({**body, "stream_options": options}, ensure_ascii=False, separators=(",", ":")).encode()
