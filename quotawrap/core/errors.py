"""quotawrap's exceptions, in branches that decide what a caller does with them.

QuotawrapError
├── PolicyRefused          quotawrap refuses by rule: a 4xx in the guarded program, never fail-open
│   ├── ConfigError        bad flag, env var or quotawrap.toml value (exit code 2)
│   └── UnknownPrice       a model without a price under ``--unknown-price error``
├── StoreError             the ledger cannot be opened, read or written (names the store): a 503,
│   │                      or an unguarded call under ``--fail-open``; exit code 4 on the CLI
│   └── StoreCorrupt       the ledger exists but is not a quotawrap ledger / is damaged
└── Unavailable            a helper quotawrap can work without (it degrades and says so)
    ├── TokenizerUnavailable   a bundled tokenizer cannot be loaded (counting falls back to bytes)
    └── BalanceUnavailable     no balance could be read (the previous snapshot stays in force)

Catch the precise branch: a price refused by policy once read as a store outage, and went out
unguarded under ``--fail-open``.
"""

from __future__ import annotations

__all__ = [
    "EXIT_BLOCKED",
    "EXIT_STORE",
    "EXIT_USAGE",
    "BalanceUnavailable",
    "ConfigError",
    "PolicyRefused",
    "QuotawrapError",
    "StoreCorrupt",
    "StoreError",
    "TokenizerUnavailable",
    "Unavailable",
    "UnknownPrice",
    "exit_code",
    "with_cure",
]

EXIT_USAGE = 2  # the CLI's answer to a rule: a flag, variable, config value or policy
EXIT_STORE = 4  # the store cannot be opened or used
EXIT_BLOCKED = 3  # --fail-on-block and a call was blocked


class QuotawrapError(Exception):
    """Root of every error quotawrap raises on purpose."""


class PolicyRefused(QuotawrapError):
    """quotawrap will not do this by rule; retrying or failing open cannot change the answer."""


class ConfigError(PolicyRefused):
    """A setting could not be understood."""


class UnknownPrice(PolicyRefused):
    """A model has no price and the policy says not to guess."""

    def __init__(self, model: str) -> None:
        import json  # only here: every guarded command imports this module before its child starts

        super().__init__(
            f"no price for model {model!r} and --unknown-price is 'error': add "
            f"[prices.{json.dumps(model)}] to quotawrap.toml (input, cached_input, output in CNY per "
            "million tokens), or allow the conservative default with --unknown-price conservative"
        )
        self.model = model


class StoreError(QuotawrapError):
    """The ledger could not be used; the message names the store."""

    def __init__(self, message: str, *, store: str) -> None:
        super().__init__(f"{message} (store: {store})")
        self.store = store


class StoreCorrupt(StoreError):
    """The ledger is damaged or is not a quotawrap ledger; it is never silently reset."""


class Unavailable(QuotawrapError):
    """Something quotawrap uses but can do without is missing; the caller degrades."""


class TokenizerUnavailable(Unavailable):
    """A bundled tokenizer could not be loaded; quotawrap never downloads one instead."""


class BalanceUnavailable(Unavailable):
    """No balance could be read; the previous snapshot stays in force."""


def exit_code(exc: QuotawrapError) -> int:
    """The CLI's exit code for an error, by branch: a rule is a usage error, the store is 4."""
    if isinstance(exc, PolicyRefused):
        return EXIT_USAGE
    return EXIT_STORE if isinstance(exc, StoreError) else 1


def with_cure(exc: QuotawrapError) -> str:
    """The error's message, with what to check when the store could not be reached."""
    if isinstance(exc, StoreError) and not isinstance(exc, StoreCorrupt):
        return f"{exc}; check that the store is running and reachable and that its URL and password are right"
    return str(exc)
