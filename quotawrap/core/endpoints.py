"""Which requests are guarded, and what they ask for. Pure: no I/O.

:func:`route` sorts every request to a guarded host (an Ark host, or under a ``--base-url``):

* a known billed POST (chat, bots, batch, responses, embeddings, images, video tasks, context
  create, classification) is guarded: reserved before it is sent, settled from its answer;
* a GET of a video task (or of the task list) is a poll: free, but its answer may carry the
  usage that settles the task's hold;
* any other POST is refused, unless ``--allow-path`` names it: quotawrap cannot estimate
  what it does not know, and a billed call it let through would be spend nobody guarded;
* any other method on a billed path (PUT, PATCH, a GET that is no poll, ...) is refused with
  405 without being sent: only POST is billed there (Ark answers the others 405), and a provider
  that billed one anyway would spend unguarded;
* every other method (GET, DELETE, ...) elsewhere is a free read and passes.

Paths are compared as a server's router would read them: percent-decoded, with repeated
slashes and dot segments folded (``//chat//completions`` is chat, not the legacy completions).
"""

from __future__ import annotations

import fnmatch
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any, Literal
from urllib.parse import SplitResult, unquote, urlsplit

from . import json_bytes
from .estimate import Kind
from .records import Record

__all__ = [
    "ARK_HOST",
    "TASKS_SUFFIX",
    "Route",
    "Router",
    "classify",
    "clean_path",
    "model_matches",
    "parse_json_body",
    "path_allowed",
    "route",
    "stream_requested",
    "wants_usage",
    "with_usage_requested",
]

# VolcEngine Ark in every region (ark.cn-beijing.volces.com, ...) and BytePlus ModelArk.
ARK_HOST = re.compile(r"^ark(?:\.[a-z0-9-]+)?\.(?:volces|bytepluses)\.com$")

_DEFAULT_PORTS = {"http": 80, "https": 443}

TASKS_SUFFIX = "/contents/generations/tasks"

# Billed paths, longest suffix first: (suffix, what to estimate, the ledger's endpoint label).
# /responses/{id} and friends are reads, not billed.
_BILLED_SUFFIXES: tuple[tuple[str, Kind, str], ...] = (
    ("/batch/chat/completions", "chat", "batch_chat"),
    ("/bots/chat/completions", "chat", "bot_chat"),
    ("/context/chat/completions", "chat", "context_chat"),
    ("/chat/completions", "chat", "chat"),
    ("/batch/embeddings/multimodal", "embeddings", "batch_embeddings"),
    ("/batch/embeddings", "embeddings", "batch_embeddings"),
    ("/embeddings/multimodal", "embeddings", "embeddings"),
    ("/embeddings", "embeddings", "embeddings"),
    ("/responses", "responses", "responses"),
    ("/completions", "completions", "completions"),
    ("/images/generations", "images", "images"),
    (TASKS_SUFFIX, "video", "video_task"),
    ("/context/create", "context", "context"),
    ("/classification", "classification", "classification"),
)
# POSTs that bill nothing: counting tokens, uploading a file, cancelling a background response.
_FREE_POST_SUFFIXES = ("/tokenization", "/files", "/cancel")
_TASK_PATH = re.compile(re.escape(TASKS_SUFFIX) + r"/([^/]+)$")

Action = Literal["guard", "poll", "refuse", "wrong_method"]


class Route(Record, frozen=True):
    """What to do with one request to a guarded host."""

    action: Action
    path: str
    kind: Kind | None = None  # guard: what to estimate
    endpoint: str = ""  # guard: the ledger's label (batch_chat, video_task, ...)
    task_id: str | None = None  # poll: the task a GET reads; None for the task list


def route(method: str, url: str, base_urls: Sequence[str] = (), allow_paths: Sequence[str] = ()) -> Route | None:
    """How to treat a request: None passes it untouched (not a guarded host, or a free read)."""
    parts = urlsplit(url)
    host = (parts.hostname or "").lower()
    if not (ARK_HOST.match(host) or any(_under(url, base) for base in base_urls)):
        return None
    path = clean_path(parts.path)
    verb = method.upper()
    if verb == "GET":
        found = _TASK_PATH.search(path)
        if found:
            return Route("poll", path, task_id=found.group(1))
        if path.endswith(TASKS_SUFFIX):
            return Route("poll", path)
    billed = next(((kind, endpoint) for suffix, kind, endpoint in _BILLED_SUFFIXES if path.endswith(suffix)), None)
    if verb != "POST":
        return None if billed is None else Route("wrong_method", path, *billed)
    if billed is not None:
        return Route("guard", path, *billed)
    if path.endswith(_FREE_POST_SUFFIXES) or path_allowed(path, allow_paths):
        return None
    return Route("refuse", path or "/")


def clean_path(path: str) -> str:
    """A URL path as a server's router is likely to match it: percent-decoded, repeated slashes and dot
    segments folded, no trailing slash ("" for the root). Reading more paths as billed is the safe side."""
    segments: list[str] = []
    for segment in unquote(path).split("/"):
        if segment == "..":
            if segments:
                segments.pop()
        elif segment not in ("", "."):
            segments.append(segment)
    return "/" + "/".join(segments) if segments else ""


class Router:
    """:func:`route` for fixed settings, remembered per (method, URL): a guarded call asks twice
    (``Guard.wants`` before its body is read, then the admission), and an agent calls few URLs."""

    _KEPT = 256

    def __init__(self, base_urls: Sequence[str], allow_paths: Sequence[str]) -> None:
        self._base_urls, self._allow_paths = tuple(base_urls), tuple(allow_paths)
        self._seen: dict[tuple[str, str], Route | None] = {}

    def __call__(self, method: str, url: str) -> Route | None:
        key = (method, url)
        try:
            return self._seen[key]
        except KeyError:
            pass
        found = route(method, url, self._base_urls, self._allow_paths)  # raises on a URL it cannot read
        if len(self._seen) >= self._KEPT:
            self._seen.clear()
        self._seen[key] = found
        return found


def path_allowed(path: str, patterns: Sequence[str]) -> bool:
    """``--allow-path`` entries: a glob over the whole path, or a path suffix at a ``/`` boundary."""
    for pattern in patterns:
        if any(ch in pattern for ch in "*?["):
            if fnmatch.fnmatchcase(path, pattern):
                return True
            continue
        tail = "/" + pattern.strip("/")
        if tail != "/" and (path == tail or path.endswith(tail)):
            return True
    return False


def classify(method: str, url: str, base_urls: Sequence[str] = ()) -> Kind | None:
    """The kind of a billed call to a guarded endpoint, or None to pass it through."""
    found = route(method, url, base_urls)
    return found.kind if found is not None and found.action == "guard" else None


def _under(url: str, base: str) -> bool:
    """Same origin and a path below the base's, compared by parts: clients spell URLs differently
    (httpx lower-cases the host and drops a default port, requests keeps both as given)."""
    target, prefix = urlsplit(url), urlsplit(base)
    if _origin(target) is None or _origin(target) != _origin(prefix):
        return False
    root, path = clean_path(prefix.path), clean_path(target.path)
    return path == root or path.startswith(root + "/")


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
        data = json_bytes.loads_request(body)
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


# json.dumps with any option builds a new encoder on every call: a request body changed on a guarded call's
# path is encoded by this one.
_BODY_ENCODER = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))


def encode_body(body: Mapping[str, Any]) -> bytes:
    """A request body as the guard sends it on: compact JSON, UTF-8 (``json.dumps`` with those options)."""
    return _BODY_ENCODER.encode(body).encode()


def encode_added(raw: bytes | None, request: Mapping[str, Any], body: Mapping[str, Any]) -> bytes:
    """``encode_body(body)`` for a ``body`` that is ``request`` with keys of its own added at its end (a bound),
    ``raw`` being the bytes ``request`` was read from.

    When ``raw`` is an object's JSON as bytes, the added keys are written before its closing brace instead of
    encoding the whole request again on every guarded call (its messages are most of it). Compact UTF-8
    JSON, as httpx writes a ``json=`` body and as ``encode_body`` writes, gives the very bytes ``encode_body``
    would; other spacing or escaping is kept as the caller wrote it, the same JSON object either way.
    """
    added = len(body) - len(request)
    if type(raw) is bytes and added > 0 and raw[:2] == b'{"' and raw[-1:] == b"}":
        members = []
        for key, value in list(body.items())[-added:]:
            if key in request:  # not new to it: it would be written twice
                return encode_body(body)
            members.append(_member(key, value))
        return b"".join((memoryview(raw)[:-1], b",", b",".join(members), b"}"))  # one copy of the request
    return encode_body(body)


def _member(key: str, value: object) -> bytes:
    """``"key":value`` as ``encode_body`` writes it. A bound (a word for its key, an int) is written directly:
    the encoder's set-up alone costs more than the write."""
    if type(value) is int and key.isascii() and key.isidentifier():
        return b'"%s":%d' % (key.encode(), value)
    return encode_body({key: value})[1:-1]


def with_usage_requested(body: Mapping[str, Any]) -> bytes:
    """The request body re-encoded with ``stream_options.include_usage`` switched on."""
    existing = body.get("stream_options")
    options = dict(existing) if isinstance(existing, Mapping) else {}
    options["include_usage"] = True
    return encode_body({**body, "stream_options": options})
