"""Whether the Redis server keeps the ledger on disk, read once as a run or a gateway starts.

A Redis that restarts with neither RDB snapshots (``save ''``) nor AOF (``appendonly no``) while no
run is alive comes back empty, and the day's spend starts again from zero: the epoch check of
:mod:`.ledger` catches a loss only while a process that saw the old epoch lives. So the server's two
settings are read with ``CONFIG GET`` and, when neither persists, the user is told once what a
restart would lose and how to keep it. A server that refuses ``CONFIG`` (managed Redis renames or
forbids it, and runs persistence itself) is left unjudged, without a word: a warning on every run
that nobody can act on teaches people to skip warnings.
"""

from __future__ import annotations

from typing import Any

from ...support.log import warn
from .client import Client, as_text

__all__ = ["no_persistence", "warn_without_persistence"]

_checked: set[str] = set()  # the stores this process has judged: one word per store, however many runs start


def no_persistence(settings: dict[str, str]) -> bool:
    """Pure: whether one server's ``save`` and ``appendonly`` keep nothing on disk."""
    save = settings.get("save", "").strip()
    appendonly = settings.get("appendonly", "").strip().lower()
    return save == "" and appendonly == "no"


def _settings(reply: Any) -> dict[str, dict[str, str]]:
    """CONFIG GET's answer by server ("" for a single node; a Cluster client answers per primary)."""
    if not isinstance(reply, dict) or not reply:
        return {}
    if all(isinstance(value, dict) for value in reply.values()):
        return {str(node): _texts(values) for node, values in reply.items()}
    return {"": _texts(reply)}


def _texts(values: dict[Any, Any]) -> dict[str, str]:
    return {str(as_text(key)): str(as_text(value) or "") for key, value in values.items()}


def warn_without_persistence(client: Client) -> bool:
    """Say once that a restart would lose the day's spend, when the server keeps nothing on disk.

    True when it warned. Never raises: a refused ``CONFIG`` (managed Redis, an ACL) or any error
    leaves the run as it was.
    """
    if client.store in _checked:
        return False
    _checked.add(client.store)
    try:
        client.connect()
        servers = _settings(client.config_get("save"))
        for node, appendonly in _settings(client.config_get("appendonly")).items():
            servers.setdefault(node, {}).update(appendonly)
    except Exception:  # CONFIG refused or the server gone: nothing to say
        return False
    if not any(no_persistence(server) for server in servers.values()):
        return False
    warn(
        f"Redis at {client.store} keeps nothing on disk (save '' and appendonly no): if it restarts while"
        " no run is alive, today's spend is forgotten and the caps count from zero again. Keep it with AOF:"
        " CONFIG SET appendonly yes (and appendonly yes in redis.conf)."
    )
    return True
