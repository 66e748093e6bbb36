"""Which Redis settings keep the ledger on disk, and how CONFIG GET's answers are read (single node, Cluster)."""

from __future__ import annotations

import pytest

from quotawrap.ledger.redis.persistence import _settings, no_persistence


@pytest.mark.parametrize(
    ("settings", "lost"),
    [
        ({"save": "", "appendonly": "no"}, True),
        ({"save": " ", "appendonly": "NO"}, True),
        ({"save": "3600 1 300 100 60 10000", "appendonly": "no"}, False),
        ({"save": "", "appendonly": "yes"}, False),
        ({"save": "900 1", "appendonly": "yes"}, False),
        ({"save": ""}, False),  # appendonly unread: not judged
        ({}, False),
    ],
)
def test_neither_rdb_nor_aof_is_no_persistence(settings: dict[str, str], lost: bool) -> None:
    assert no_persistence(settings) is lost


def test_config_get_answers_per_server() -> None:
    """A node answers one dict (bytes or text); a Cluster client one dict per primary."""
    assert _settings({b"save": b"", b"appendonly": b"no"}) == {"": {"save": "", "appendonly": "no"}}
    per_node = {"127.0.0.1:7000": {"save": ""}, "127.0.0.1:7001": {b"save": b"900 1"}}
    assert _settings(per_node) == {"127.0.0.1:7000": {"save": ""}, "127.0.0.1:7001": {"save": "900 1"}}
    assert _settings(None) == {}
