"""The gateway's member keys in Redis: a hash of records by key hash, and a hash of names (docs/redis.md).

``member_keys`` maps a key's SHA-256 to its record (JSON: name, tags, created_at, revoked_at), so the
gateway finds a caller's key in one HGET; ``member_key_names`` maps each name to its key's hash and makes
names unique (HSETNX). A key is written record first, name second: a name lost to a concurrent ``keys add``
takes its record back, and a record whose name was never written belongs to a key nobody was shown.
Revoking rewrites the record with its time; names are never reused, so a revoked key stays listed.
"""

from __future__ import annotations

import dataclasses
import json

from ...core.member_keys import MemberKey
from .client import Client
from .keys import Keys

__all__ = ["add_member_key", "member_key", "member_keys", "revoke_member_key"]


def _record(key: MemberKey) -> str:
    data = {"name": key.name, "tags": dict(key.tags), "created_at": key.created_at, "revoked_at": key.revoked_at}
    return json.dumps(data, ensure_ascii=False, sort_keys=True)


def _parse(hashed: str, raw: str) -> MemberKey:
    data = json.loads(raw)
    revoked = data.get("revoked_at")
    return MemberKey(
        str(data["name"]),
        hashed,
        {str(k): str(v) for k, v in data.get("tags", {}).items()},
        float(data["created_at"]),
        None if revoked is None else float(revoked),
    )


def add_member_key(client: Client, keys: Keys, key: MemberKey) -> bool:
    records, names = keys.member_keys(), keys.member_key_names()

    def write() -> bool:
        client.write([("HSET", records, key.key_hash, _record(key))])
        # a retry after a lost reply finds the name already ours
        if client.hsetnx(names, key.name, key.key_hash) or client.hget(names, key.name) == key.key_hash:
            return True
        client.write([("HDEL", records, key.key_hash)])
        return False

    return client.retrying("member keys", write)


def member_key(client: Client, keys: Keys, hashed: str) -> MemberKey | None:
    raw = client.retrying("read", lambda: client.hget(keys.member_keys(), hashed))
    return None if raw is None else _parse(hashed, raw)


def member_keys(client: Client, keys: Keys) -> list[MemberKey]:
    def read() -> list[MemberKey]:
        names = client.hgetall(keys.member_key_names())
        records = client.hgetall(keys.member_keys())
        return [_parse(hashed, records[hashed]) for hashed in names.values() if hashed in records]

    return sorted(client.retrying("read", read), key=lambda key: (key.created_at, key.name))


def revoke_member_key(client: Client, keys: Keys, name: str, at: float) -> MemberKey | None:
    def revoke() -> MemberKey | None:
        hashed = client.hget(keys.member_key_names(), name)
        raw = None if hashed is None else client.hget(keys.member_keys(), hashed)
        if hashed is None or raw is None:
            return None
        key = _parse(hashed, raw)
        if key.revoked_at is None:  # a second revoke keeps the first time
            key = dataclasses.replace(key, revoked_at=at)
            client.write([("HSET", keys.member_keys(), hashed, _record(key))])
        return key

    return client.retrying("member keys", revoke)
