"""The gateway's member keys in a SQLite ledger: one row of ``member_keys`` (file.py) per key, found by the
key's hash; the key itself is never written."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Sequence
from typing import Any

from ...core.member_keys import MemberKey

__all__ = ["add_member_key", "member_key", "member_keys", "revoke_member_key"]

_COLUMNS = "name, key_hash, tags, created_at, revoked_at"


def _key(row: Sequence[Any]) -> MemberKey:
    name, hashed, tags, created_at, revoked_at = row
    return MemberKey(name, hashed, json.loads(tags), created_at, revoked_at)


def add_member_key(conn: sqlite3.Connection, key: MemberKey) -> bool:
    """Keep ``key`` unless its name is taken (names are never reused, revoked or not); whether it was kept."""
    tags = json.dumps(dict(key.tags), ensure_ascii=False, sort_keys=True)
    row = (key.name, key.key_hash, tags, key.created_at, key.revoked_at)
    return conn.execute(f"INSERT OR IGNORE INTO member_keys ({_COLUMNS}) VALUES (?, ?, ?, ?, ?)", row).rowcount == 1


def member_key(conn: sqlite3.Connection, hashed: str) -> MemberKey | None:
    row = conn.execute(f"SELECT {_COLUMNS} FROM member_keys WHERE key_hash = ?", (hashed,)).fetchone()
    return None if row is None else _key(row)


def member_keys(conn: sqlite3.Connection) -> list[MemberKey]:
    rows = conn.execute(f"SELECT {_COLUMNS} FROM member_keys ORDER BY created_at, name").fetchall()
    return [_key(row) for row in rows]


def revoke_member_key(conn: sqlite3.Connection, name: str, at: float) -> MemberKey | None:
    """Mark the key revoked at ``at`` (a second revoke keeps the first time); its record, or None for no such name."""
    conn.execute("UPDATE member_keys SET revoked_at = ? WHERE name = ? AND revoked_at IS NULL", (at, name))
    row = conn.execute(f"SELECT {_COLUMNS} FROM member_keys WHERE name = ?", (name,)).fetchone()
    return None if row is None else _key(row)
