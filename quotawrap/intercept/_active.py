"""The process's one guard, kept apart from the package so the adapters can import it without a cycle."""

from __future__ import annotations

import _thread

TYPE_CHECKING = False  # importing typing itself would slow every child's start-up
if TYPE_CHECKING:
    from collections.abc import Mapping

    from ..admission.guard import Guard

__all__ = ["get_guard", "set_guard"]

_guard: Guard | None = None
_guard_lock = _thread.allocate_lock()


def get_guard() -> Guard | None:
    """The process's guard, built from ``QUOTAWRAP_*`` variables on first use."""
    global _guard
    if _guard is None:
        with _guard_lock:
            if _guard is None:
                # Imported here, not at the top: a child that never imports an HTTP client
                # must not pay for the guard's imports at start-up.
                from ..admission.guard import Guard
                from ..config.settings import Settings
                from ..core.errors import QuotawrapError

                try:  # the child's one guard: settles off the caller's path, flushed at exit and before fork
                    _guard = Guard(Settings.from_env(), background_settle=True)
                except QuotawrapError as exc:  # a bad QUOTAWRAP_* value set inside the program
                    _guard = _refusing(exc)
    return _guard


def _refusing(error: Exception) -> Guard:
    """A guard that answers every guarded call with a 400 naming the bad setting: never unguarded, never raised."""
    import contextlib
    import os

    from ..admission.guard import Guard
    from ..config.settings import OPTIONS, Settings, env_name, parse_value
    from ..core.errors import QuotawrapError
    from ..core.synthetic import SyntheticResponse
    from ..settling.call import GuardedCall
    from ..support.log import warn

    base_url: tuple[str, ...] = ()
    option = next(option for option in OPTIONS if option.name == "base_url")
    raw = os.environ.get(env_name(option.name))
    if raw is not None:
        with contextlib.suppress(QuotawrapError):  # Ark's own hosts are still recognised
            base_url = parse_value(option, raw)
    message = f"quotawrap refuses this call: its settings are invalid in this process ({error})"
    warn(f"{error}; every guarded call of this process is refused")

    class Refusing(Guard):
        def begin(self, method: str, url: str, headers: Mapping[str, str], body: bytes | None) -> GuardedCall | None:
            if not self.wants(method, url):
                return None
            return GuardedCall.refused(
                SyntheticResponse.ark_error(400, "QuotawrapPolicyRefused", "BadRequest", message)
            )

    return Refusing(Settings(base_url=base_url))


def set_guard(guard: Guard | None) -> None:
    """Use this guard (tests; embedding); None rebuilds one from the environment on next use."""
    global _guard
    _guard = guard
