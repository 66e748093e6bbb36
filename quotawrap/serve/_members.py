"""The gateway's door when it holds the provider's key: only member keys come in, the provider's goes out.

``quotawrap serve --upstream-key-env VAR`` reads the provider's key from ``VAR`` (never from a flag, which
``ps`` would show). From then on every request must bring a member key (``quotawrap keys add``) as its
bearer token; a missing, unknown or revoked one is answered 401 and nothing is sent. An admitted request
goes upstream with the provider's key in place of the member's, and is guarded with the member's tags.
Every request's key is looked up in the ledger, with no cache: a key added or revoked counts from the
next request, on every gateway sharing the ledger.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from ..core.errors import ConfigError, QuotawrapError
from ..core.member_keys import MemberKey, key_hash, presented_key, refusal
from ..core.redact import redact_text
from ..core.synthetic import SyntheticResponse
from ..support.log import warn

__all__ = ["MemberGate", "provider_key"]


def provider_key(variable: str, environ: Mapping[str, str]) -> str:
    """The provider's key held in ``variable``; a ConfigError, which never quotes a value, when there is none."""
    if not (variable.isascii() and variable.isidentifier()):
        raise ConfigError(
            "--upstream-key-env (QUOTAWRAP_UPSTREAM_KEY_ENV) takes the name of an environment variable that"
            " holds the provider's key, e.g. ARK_API_KEY; what was given is no variable name (not shown: it may be"
            " the key itself)"
        )
    key = environ.get(variable, "").strip()
    if not key:
        raise ConfigError(
            f"--upstream-key-env {variable}: the variable {variable} is not set (or empty) in serve's environment;"
            f" export {variable}=<the provider's API key> first"
        )
    return key


class MemberGate:
    """Who may call through the gateway, and the credential its calls go upstream with."""

    def __init__(self, variable: str, key: str, lookup: Callable[[str], MemberKey | None]) -> None:
        self.variable = variable
        self._authorization = f"Bearer {key}"
        self._lookup = lookup
        self._upstream_refused = False

    def __repr__(self) -> str:
        return f"MemberGate(provider key from ${self.variable})"

    def admit(self, headers: Mapping[str, str]) -> MemberKey | SyntheticResponse:
        """The caller's member key, or the answer that refuses it (401, or 503 when the ledger cannot say)."""
        secret = presented_key(headers)
        if secret is None:
            return refusal(None, sent=False)
        try:
            key = self._lookup(key_hash(secret))
        except QuotawrapError as exc:  # never let a call through unchecked, --fail-open or not
            message = (
                f"quotawrap's gateway cannot reach its ledger to check the member key, so it refuses the call"
                f" (member keys are checked even under --fail-open): {redact_text(str(exc))}"
            )
            return SyntheticResponse.ark_error(503, "QuotawrapStoreUnavailable", "ServiceUnavailable", message)
        if key is None or key.revoked_at is not None:
            return refusal(key, sent=True)
        return key

    def upstream_headers(self, headers: list[tuple[str, str]]) -> list[tuple[str, str]]:
        """A member's request headers as they go upstream: its key replaced by the provider's."""
        return [(name, value) for name, value in headers if name.lower() != "authorization"] + [
            ("Authorization", self._authorization)
        ]

    def upstream_answered(self, status: int) -> None:
        """Say once on stderr when the provider refuses its key: every member's call fails then, not theirs alone."""
        if status in (401, 403) and not self._upstream_refused:
            self._upstream_refused = True
            warn(
                f"gateway: the upstream answered {status} to a member's call: it may refuse the provider key"
                f" held from ${self.variable} (members see the upstream's answer); check the key"
            )
