"""Secrets out of everything quotawrap shows or stores: store URLs and command lines.

A command line is kept because it says which program spent the money; its secrets are not.
An argument is hidden when its name looks secret (``--api-key X``, ``--api-key=X``,
``token=X``) or its value does (``sk-...``, ``Bearer ...``, a URL with a password). Pure.
"""

from __future__ import annotations

TYPE_CHECKING = False
if TYPE_CHECKING:
    import re
    from collections.abc import Mapping, Sequence

__all__ = [
    "HIDDEN",
    "join_command",
    "key_fingerprint",
    "plain_argument",
    "redact_argv",
    "redact_command_line",
    "redact_text",
    "redact_url",
]

HIDDEN = "***"

# Every guarded command redacts its command line as it starts, so a command line whose arguments hold none of
# these fragments (in any ASCII case) is kept as it is without loading `re` (test_redact_and_files.py proves it).
_NAME_FRAGMENTS = ("key", "secret", "token", "pass", "pwd", "auth", "credential", "cookie", "sk")
_VALUE_FRAGMENTS = ("sk-", "ak-", "aklt", "gh", "github_pat", "xox", "aiza", "bearer", "basic", "token", "://")


class _Patterns:
    """The patterns, compiled on first use."""

    def __init__(self) -> None:
        import re

        # a name that announces a secret: api-key, api_key, apikey, token, secret, password, passwd, pwd, auth...
        self.secret_name = re.compile(
            r"(?:^|[-_.])(?:api[-_]?key|access[-_]?key|secret|token|password|passwd|pwd|auth|authorization|"
            r"credentials?|cookie|private[-_]?key|session[-_]?key|sk)$|^(?:key|pass)$",
            re.IGNORECASE,
        )
        # values that are secrets whatever they are called
        self.secret_value = re.compile(
            r"\b(?:sk-[A-Za-z0-9_\-]{6,}|ak-[A-Za-z0-9_\-]{6,}|AKLT[A-Za-z0-9_\-]{8,}|gh[pousr]_[A-Za-z0-9]{10,}|github_pat_[A-Za-z0-9_]{10,}"
            r"|xox[abposr]-[A-Za-z0-9\-]{8,}|AIza[A-Za-z0-9_\-]{20,})"
            # an Authorization scheme's credential whatever its length; after "token", six characters at least
            r"|(?i:\b(?:bearer|basic)\s+)[A-Za-z0-9._~+/=\-]+|(?i:\btoken\s+)[A-Za-z0-9._~+/=\-]{6,}"
        )
        self.url_password = re.compile(r"(?P<head>[A-Za-z][A-Za-z0-9+.\-]*://[^/\s:@]*:)(?P<password>[^@\s/]+)(?=@)")
        self.query_secret = re.compile(
            r"(?P<head>[?&](?:password|passwd|pwd|pass|token|secret|api[-_]?key|access[-_]?key|auth)=)[^&\s)'\"]+",
            re.IGNORECASE,
        )


_compiled: list[_Patterns] = []


def _patterns() -> _Patterns:
    if not _compiled:
        _compiled.append(_Patterns())  # two threads may both compile: the same patterns either way
    return _compiled[0]


def plain_argument(arg: str) -> bool:
    """Whether no rule of this module can hide anything in ``arg`` (checked without ``re``)."""
    if not arg.isascii():  # re's case folding matches letters beyond ASCII (the long s, the Kelvin sign)
        return False
    low = arg.lower()
    if any(fragment in low for fragment in _VALUE_FRAGMENTS):
        return False
    if "=" in arg and ("?" in arg or "&" in arg):  # a query's secret parameter
        return False
    named = arg.startswith("-") or "=" in arg  # read as a name (--api-key, token=...)
    return not (named and any(fragment in low for fragment in _NAME_FRAGMENTS))


def _secret_name(name: str) -> bool:
    return bool(_patterns().secret_name.search(name.strip().lstrip("-")))


def redact_url(url: str) -> str:
    """``redis://user:pw@host/0?password=pw`` -> ``redis://user:***@host/0?password=***``.

    Edits the text in place rather than through ``urlunsplit``, which rewrites ``sqlite:////p``
    and ``unix:///p`` into other URLs.
    """
    from urllib.parse import parse_qsl, urlencode, urlsplit  # not on a guarded command's start path

    try:
        parts = urlsplit(url)
    except ValueError:
        return redact_text(url)
    prefix = f"{parts.scheme}://{parts.netloc}"
    if not parts.scheme or not url.startswith(prefix):
        return redact_text(url)
    netloc, tail = parts.netloc, url[len(prefix) :]
    if "@" in netloc:
        userinfo, _, host = netloc.rpartition("@")
        user, sep, _password = userinfo.partition(":")
        # a lone userinfo is hidden too: in https://TOKEN@host it is the secret
        netloc = f"{user}:{HIDDEN}@{host}" if sep else f"{HIDDEN}@{host}"
    if parts.query:
        pairs = parse_qsl(parts.query, keep_blank_values=True)
        query = urlencode([(key, HIDDEN if _secret_name(key) else value) for key, value in pairs], safe="*")
        tail = tail.replace("?" + parts.query, "?" + query, 1)
    return f"{parts.scheme}://{netloc}{tail}"


def redact_text(text: str) -> str:
    """Hide secret-looking values anywhere in free text (and passwords in URLs)."""
    patterns = _patterns()
    text = patterns.url_password.sub(_head_kept, text)
    text = patterns.query_secret.sub(_head_kept, text)
    return patterns.secret_value.sub(lambda m: _keep_scheme(m.group(0)), text)


def _head_kept(match: re.Match[str]) -> str:
    return match.group("head") + HIDDEN


def _keep_scheme(found: str) -> str:
    word, space, _rest = found.partition(" ")
    if space and word.lower() in ("bearer", "basic", "token"):
        return f"{word} {HIDDEN}"
    return HIDDEN


def redact_argv(argv: Sequence[str]) -> list[str]:
    """The command with secret arguments and values replaced by ``***``."""
    if all(plain_argument(arg) for arg in argv):
        return list(argv)
    return _redact_each(argv)


def _redact_each(argv: Sequence[str]) -> list[str]:
    out: list[str] = []
    hide_next = False
    for arg in argv:
        if hide_next and not arg.startswith("-"):  # "--no-auth --model m": a switch, not a value
            out.append(HIDDEN)
            hide_next = False
            continue
        hide_next = False
        if arg.startswith("-") and "=" not in arg and _secret_name(arg):
            out.append(arg)
            hide_next = True
            continue
        name, sep, value = arg.partition("=")
        if sep and value and name and " " not in name and _secret_name(name):
            out.append(f"{name}={HIDDEN}")
            continue
        if "://" in arg:
            arg = redact_url(arg) if " " not in arg else redact_text(arg)
        out.append(redact_text(arg))
    return out


def redact_command_line(line: str) -> str:
    """A stored ``shlex.join``-ed command line, redacted (older ledgers may hold one in clear)."""
    import shlex

    try:
        return join_command(redact_argv(shlex.split(line)))
    except ValueError:
        return redact_text(line)


# shlex.quote's safe characters (its [^\w@%+=:,./-] with re.ASCII)
_SAFE = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_@%+=:,./-")


def join_command(argv: Sequence[str]) -> str:
    """``shlex.join(argv)``, without importing shlex (and re) on a guarded command's start."""
    return " ".join(arg if arg and _SAFE.issuperset(arg) else "'" + arg.replace("'", "'\"'\"'") + "'" for arg in argv)


def key_fingerprint(headers: Mapping[str, str]) -> str | None:
    """Which API key made a call, without the key: a short hash of the Authorization header's secret."""
    auth = headers.get("authorization") or headers.get("Authorization")
    if not auth:
        return None
    known = _fingerprints.get(auth)  # every guarded call asks, nearly always for the same few keys
    if known is not None:
        return known
    secret = auth.split(" ", 1)[-1].strip().encode()
    import hashlib  # only a secret to fingerprint pays for its import, not every guarded command's start

    if len(_fingerprints) >= 64:
        _fingerprints.clear()
    known = _fingerprints[auth] = "sha256:" + hashlib.sha256(secret).hexdigest()[:16]
    return known


_fingerprints: dict[str, str] = {}  # Authorization header -> its fingerprint (the header holds a secret: memory only)
