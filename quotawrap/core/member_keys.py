"""Member keys for the gateway: their form, what the ledger keeps of them, and what a member's call carries. Pure.

A gateway that holds the provider's key (``quotawrap serve --upstream-key-env VAR``) takes a member key
from each caller instead: ``qwk-`` and 43 URL-safe characters, 32 random bytes from :mod:`secrets`. The
ledger keeps the key's SHA-256, never the key. With 256 random bits the plain hash can be neither reversed
nor guessed, so no salt is needed, and the gateway finds a key's record by hashing what the caller sent.
The hash's first 16 hex digits, written ``sha256:…``, are the fingerprint a call record keeps of the key it
came with (``redact.key_fingerprint``), so ``keys list`` and the calls name a member's key alike.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Mapping

from .errors import ConfigError
from .records import Record
from .synthetic import SyntheticResponse

__all__ = [
    "KEY_NAME_TAG",
    "KEY_PREFIX",
    "MemberKey",
    "check_key_name",
    "check_key_tags",
    "fingerprint",
    "key_hash",
    "member_tags",
    "new_member_key",
    "presented_key",
    "refusal",
]

KEY_PREFIX = "qwk-"
#: The tag each member's call carries with the key's name, so budgets and reports can tell members apart.
KEY_NAME_TAG = "key"
_SECRET_BYTES = 32
_NAME_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.-")
_NAME_MAX = 64


class MemberKey(Record, frozen=True):
    """What the ledger keeps of one member key: never the key itself."""

    name: str
    key_hash: str  # sha256 of the whole key, hex
    tags: Mapping[str, str]
    created_at: float
    revoked_at: float | None = None

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.key_hash)


def new_member_key() -> str:
    """A fresh member key: shown once, to be handed to the member; only its hash is kept."""
    return KEY_PREFIX + secrets.token_urlsafe(_SECRET_BYTES)


def key_hash(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def fingerprint(hashed: str) -> str:
    """``sha256:`` and the first 16 hex digits: what a call record keeps of the key it came with."""
    return "sha256:" + hashed[:16]


def check_key_name(name: str) -> None:
    """A name for ``keys add``: a ConfigError naming the rule when it breaks it."""
    if not name or len(name) > _NAME_MAX or not set(name) <= _NAME_CHARS:
        raise ConfigError(
            f"key name {name[:_NAME_MAX]!r}: use 1 to {_NAME_MAX} letters, digits, '_', '.' or '-'"
            " (e.g. ana, ci-search)"
        )


def check_key_tags(tags: Mapping[str, str]) -> None:
    """A key's tags may not set the one tag the gateway writes itself: the key's name."""
    if KEY_NAME_TAG in tags:
        raise ConfigError(f"--tag {KEY_NAME_TAG}=...: every member's call carries {KEY_NAME_TAG}=NAME already")


def presented_key(headers: Mapping[str, str]) -> str | None:
    """The secret of the caller's ``Authorization: Bearer …``, or None when it sent none."""
    auth = headers.get("authorization") or headers.get("Authorization") or ""
    scheme, _, secret = auth.strip().partition(" ")
    secret = secret.strip()
    return secret if scheme.lower() == "bearer" and secret else None


def member_tags(key: MemberKey) -> dict[str, str]:
    """The tags a member's call carries over the gateway's own: the key's, and its name."""
    return {**key.tags, KEY_NAME_TAG: key.name}


def refusal(key: MemberKey | None, *, sent: bool) -> SyntheticResponse:
    """The 401 of a call without a usable member key, in Ark's shape and with Ark's code for a bad key.

    ``sent``: the caller brought a bearer secret (``key`` is its record when the ledger knows it)."""
    if key is not None and key.revoked_at is not None:
        why = f"the member key {key.name!r} ({key.fingerprint}) was revoked"
    elif sent:
        why = "the key sent is not a member key of this gateway"
    else:
        why = "no member key was sent (Authorization: Bearer qwk-…)"
    message = (
        f"quotawrap's gateway refused this request: {why}. It holds the provider's key itself and takes"
        " member keys instead; ask its operator for one (quotawrap keys add NAME)."
    )
    return SyntheticResponse.ark_error(401, "AuthenticationError", "Unauthorized", message)
