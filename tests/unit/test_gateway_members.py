"""The gateway's door for member keys (quotawrap/serve/_members.py), against a real SQLite ledger."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from quotawrap.core.errors import ConfigError
from quotawrap.core.member_keys import MemberKey, key_hash, new_member_key
from quotawrap.core.synthetic import SyntheticResponse
from quotawrap.ledger import Ledger, open_ledger
from quotawrap.serve._members import MemberGate, provider_key
from tests.redis_server import free_port

PROVIDER_KEY = "0b7c3f7e-5d2a-4f0e-9c61-2f4a8e1d9b35"


@pytest.fixture
def ledger(tmp_path: Path) -> Iterator[Ledger]:
    opened = open_ledger(f"sqlite:///{tmp_path / 'ledger.sqlite3'}")
    try:
        yield opened
    finally:
        opened.close()


def _error(answer: MemberKey | SyntheticResponse) -> tuple[int, str, str]:
    assert isinstance(answer, SyntheticResponse), answer
    error = json.loads(answer.body)["error"]
    return answer.status, error["code"], error["message"]


class TestProviderKey:
    def test_read_from_the_variable_named(self) -> None:
        assert provider_key("ARK_API_KEY", {"ARK_API_KEY": f" {PROVIDER_KEY}\n"}) == PROVIDER_KEY

    @pytest.mark.parametrize("environ", [{}, {"ARK_API_KEY": ""}, {"ARK_API_KEY": "  "}])
    def test_a_variable_unset_or_empty_is_named_with_the_cure(self, environ: dict[str, str]) -> None:
        with pytest.raises(ConfigError, match=r"ARK_API_KEY is not set .* export ARK_API_KEY="):
            provider_key("ARK_API_KEY", environ)

    @pytest.mark.parametrize("given", [PROVIDER_KEY, "sk-abc def", "1ARK", "ÄRK_KEY", ""])
    def test_what_is_no_variable_name_is_refused_unshown(self, given: str) -> None:
        """It may be the key itself, passed where its variable's name belongs."""
        with pytest.raises(ConfigError, match="no variable name") as caught:
            provider_key(given, {given: "x"})
        assert not given or given not in str(caught.value)


class TestAdmit:
    def test_only_a_known_unrevoked_member_key_comes_in(self, ledger: Ledger) -> None:
        gate = MemberGate("ARK_API_KEY", PROVIDER_KEY, ledger.member_key)
        secret, other = new_member_key(), new_member_key()
        ana = MemberKey("ana", key_hash(secret), {"team": "search"}, time.time())
        bob = MemberKey("bob", key_hash(other), {}, time.time())
        assert ledger.add_member_key(ana) and ledger.add_member_key(bob)
        ledger.revoke_member_key("bob", time.time())

        assert gate.admit({"authorization": f"Bearer {secret}"}) == ana
        assert _error(gate.admit({}))[:2] == (401, "AuthenticationError")
        assert "no member key was sent" in _error(gate.admit({"authorization": "Basic dXNlcjpwdw=="}))[2]
        assert "not a member key" in _error(gate.admit({"authorization": f"Bearer {new_member_key()}"}))[2]
        assert "not a member key" in _error(gate.admit({"authorization": f"Bearer {PROVIDER_KEY}"}))[2]
        assert "'bob'" in _error(gate.admit({"authorization": f"Bearer {other}"}))[2]

    def test_a_ledger_that_cannot_answer_refuses_with_503(self) -> None:
        down = open_ledger(f"redis://127.0.0.1:{free_port()}/0?socket_timeout=1")
        try:
            gate = MemberGate("ARK_API_KEY", PROVIDER_KEY, down.member_key)
            status, code, _ = _error(gate.admit({"authorization": f"Bearer {new_member_key()}"}))
        finally:
            down.close()
        assert (status, code) == (503, "QuotawrapStoreUnavailable")


class TestUpstreamHeaders:
    def test_the_members_key_is_replaced_by_the_providers_and_the_rest_kept(self) -> None:
        gate = MemberGate("ARK_API_KEY", PROVIDER_KEY, lambda hashed: None)
        sent = gate.upstream_headers(
            [("AUTHORIZATION", "Bearer qwk-x"), ("content-type", "application/json"), ("x-a", "1"), ("x-a", "2")]
        )
        assert sent == [
            ("content-type", "application/json"),
            ("x-a", "1"),
            ("x-a", "2"),
            ("Authorization", f"Bearer {PROVIDER_KEY}"),
        ]

    def test_the_gate_never_shows_the_key(self) -> None:
        gate = MemberGate("ARK_API_KEY", PROVIDER_KEY, lambda hashed: None)
        assert PROVIDER_KEY not in repr(gate) and "ARK_API_KEY" in repr(gate)
