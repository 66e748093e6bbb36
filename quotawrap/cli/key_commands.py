"""``quotawrap keys``: the member keys a gateway that holds the provider's key takes from its callers instead.

``keys add`` prints a new key once, alone on stdout (``KEY=$(quotawrap keys add ana --tag team=search)``);
the ledger keeps its hash and tags, never the key. ``keys list`` shows names, tags, times and fingerprints,
``keys revoke`` refuses a key from the gateway's next call on. See docs/gateway.md ("Member keys").
"""

from __future__ import annotations

import json
import time
from datetime import datetime
from typing import Any

import click

from ..core.errors import EXIT_USAGE, ConfigError, QuotawrapError, exit_code, with_cure
from ..core.member_keys import MemberKey, check_key_name, check_key_tags, key_hash, new_member_key
from ..core.quota import BEIJING
from ..ledger import open_store
from ..support.log import fail
from .common import command_settings, echo, settings_options

__all__ = ["keys_group"]


def _when(ts: float) -> str:
    return datetime.fromtimestamp(ts, BEIJING).strftime("%Y-%m-%d %H:%M")


def _tags(key: MemberKey) -> str:
    return ",".join(f"{name}={value}" for name, value in sorted(key.tags.items())) or "-"


def render_member_keys(keys: list[MemberKey]) -> str:
    if not keys:
        return "no member keys (quotawrap keys add NAME --tag team=...)"
    lines = []
    for key in keys:
        state = f"revoked {_when(key.revoked_at)}" if key.revoked_at is not None else "active"
        lines.append(f"{key.name}  {key.fingerprint}  created {_when(key.created_at)}  {state}  {_tags(key)}")
    return "\n".join(lines) + "\n(times in Beijing)"


@click.group("keys")
def keys_group() -> None:
    """Member keys for a gateway that holds the provider's key (serve --upstream-key-env VAR)."""


@keys_group.command("add")
@settings_options(["store"])
@click.argument("name")
@click.option(
    "--tag",
    "tags",
    multiple=True,
    metavar="KEY=VALUE",
    help="A tag every call made with this key carries, e.g. team=search (repeatable).",
)
def add_command(name: str, tags: tuple[str, ...], **values: Any) -> None:
    """Make a member key NAME and print it once; the ledger keeps only its hash and tags."""
    from ..core.tags import parse_tags

    try:
        check_key_name(name)
        parsed = parse_tags(list(tags))
        check_key_tags(parsed)
    except ConfigError as exc:
        fail(str(exc), EXIT_USAGE)
    ledger = open_store(command_settings(values))
    secret = new_member_key()
    key = MemberKey(name, key_hash(secret), parsed, time.time())
    try:
        kept = ledger.add_member_key(key)
    except QuotawrapError as exc:
        fail(with_cure(exc), exit_code(exc))
    if not kept:
        fail(
            f"a member key named {name!r} exists already; names are never reused, revoked or not: pick another"
            f" (e.g. {name}-2)",
            EXIT_USAGE,
        )
    echo(
        f"member key {name} ({key.fingerprint}, tags {_tags(key)}) added. It is shown this once (quotawrap keeps"
        " only its hash): hand it to its holder now.",
        err=True,
    )
    click.echo(secret)


@keys_group.command("list")
@settings_options(["store"])
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def list_command(as_json: bool, **values: Any) -> None:
    """Every member key: name, fingerprint, when made, whether revoked, tags (never the key)."""
    ledger = open_store(command_settings(values))
    try:
        keys = ledger.member_keys()
    except QuotawrapError as exc:
        fail(with_cure(exc), exit_code(exc))
    if as_json:
        rows = [
            {
                "name": key.name,
                "fingerprint": key.fingerprint,
                "tags": dict(key.tags),
                "created_at": key.created_at,
                "revoked_at": key.revoked_at,
            }
            for key in keys
        ]
        click.echo(json.dumps(rows, indent=2, sort_keys=True, ensure_ascii=False))
    else:
        echo(render_member_keys(keys))


@keys_group.command("revoke")
@settings_options(["store"])
@click.argument("name")
def revoke_command(name: str, **values: Any) -> None:
    """Refuse the member key NAME from the gateway's next call on (its calls stay in the books)."""
    ledger = open_store(command_settings(values))
    now = time.time()
    try:
        key = ledger.revoke_member_key(name, now)
    except QuotawrapError as exc:
        fail(with_cure(exc), exit_code(exc))
    if key is None:
        fail(f"no member key named {name!r} (quotawrap keys list shows them)", EXIT_USAGE)
    assert key.revoked_at is not None
    if key.revoked_at < now:
        echo(f"member key {key.name} ({key.fingerprint}) was already revoked at {_when(key.revoked_at)} Beijing")
    else:
        echo(f"member key {key.name} ({key.fingerprint}) revoked: every gateway refuses it from its next call")
