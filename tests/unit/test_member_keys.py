"""The member keys' rules: their form, the hash and fingerprint kept of them, names, tags and the 401."""

from __future__ import annotations

import hashlib
import json

import pytest

from quotawrap.core.errors import ConfigError
from quotawrap.core.member_keys import (
    KEY_NAME_TAG,
    KEY_PREFIX,
    MemberKey,
    check_key_name,
    check_key_tags,
    fingerprint,
    key_hash,
    member_tags,
    new_member_key,
    presented_key,
    refusal,
)
from quotawrap.core.redact import key_fingerprint, redact_text


def _key(name: str, tags: dict[str, str] | None = None, *, revoked: float | None = None) -> MemberKey:
    return MemberKey(name, key_hash(f"{KEY_PREFIX}{name}"), tags or {}, 1_700_000_000.0, revoked)


class TestNewMemberKey:
    def test_a_key_has_the_prefix_and_32_random_bytes(self) -> None:
        """43 URL-safe characters after the prefix: 256 bits, so a plain hash of it cannot be guessed back."""
        keys = {new_member_key() for _ in range(200)}
        assert len(keys) == 200
        for key in keys:
            assert key.startswith(KEY_PREFIX)
            secret = key[len(KEY_PREFIX) :]
            assert len(secret) == 43
            assert set(secret) <= set("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_")

    def test_a_key_is_hidden_wherever_quotawrap_hides_a_bearer_secret(self) -> None:
        """An Authorization header that leaks into a log line is redacted like any other key."""
        key = new_member_key()
        assert key not in redact_text(f"Authorization: Bearer {key}")


class TestHashAndFingerprint:
    def test_the_hash_is_the_keys_sha256(self) -> None:
        key = new_member_key()
        assert key_hash(key) == hashlib.sha256(key.encode()).hexdigest()
        assert key not in key_hash(key)

    def test_the_fingerprint_is_the_one_every_call_record_keeps(self) -> None:
        """`keys list` and the calls (redact.key_fingerprint of the Authorization header) name a key alike."""
        key = new_member_key()
        record = MemberKey("ana", key_hash(key), {}, 0.0)
        assert record.fingerprint == key_fingerprint({"authorization": f"Bearer {key}"})
        assert record.fingerprint == fingerprint(key_hash(key))
        assert record.fingerprint.startswith("sha256:") and len(record.fingerprint) == len("sha256:") + 16


class TestNames:
    @pytest.mark.parametrize("name", ["ana", "ci-search", "Bob_2", "team.search", "a", "x" * 64])
    def test_a_good_name_passes(self, name: str) -> None:
        check_key_name(name)

    @pytest.mark.parametrize("name", ["", "x" * 65, "ana bob", "ana/1", "ana=1", "ännä", "a\nb", "a,b"])
    def test_a_bad_name_names_the_rule(self, name: str) -> None:
        with pytest.raises(ConfigError, match="letters, digits"):
            check_key_name(name)


class TestTags:
    def test_the_key_name_tag_is_the_gateways_to_write(self) -> None:
        with pytest.raises(ConfigError, match=f"{KEY_NAME_TAG}=NAME"):
            check_key_tags({"team": "search", KEY_NAME_TAG: "bob"})
        check_key_tags({"team": "search", "user": "ana"})

    @pytest.mark.parametrize(
        ("key_tags", "expected"),
        [
            ({}, {"key": "ana"}),
            ({"team": "search"}, {"team": "search", "key": "ana"}),
            ({"team": "search", "user": "ana"}, {"team": "search", "user": "ana", "key": "ana"}),
        ],
    )
    def test_a_members_call_carries_the_keys_tags_and_its_name(
        self, key_tags: dict[str, str], expected: dict[str, str]
    ) -> None:
        assert member_tags(_key("ana", key_tags)) == expected


class TestPresentedKey:
    @pytest.mark.parametrize(
        ("headers", "expected"),
        [
            ({"authorization": "Bearer qwk-abc"}, "qwk-abc"),
            ({"Authorization": "bearer   qwk-abc  "}, "qwk-abc"),
            ({"authorization": "Basic dXNlcjpwdw=="}, None),
            ({"authorization": "Bearer "}, None),
            ({"authorization": "qwk-abc"}, None),
            ({}, None),
        ],
    )
    def test_only_a_bearer_secret_is_a_presented_key(self, headers: dict[str, str], expected: str | None) -> None:
        assert presented_key(headers) == expected


class TestRefusal:
    @pytest.mark.parametrize(
        ("key", "sent", "says"),
        [
            (None, False, "no member key was sent"),
            (None, True, "not a member key of this gateway"),
            (_key("ana", revoked=1_700_000_100.0), True, "'ana' (sha256:"),
        ],
    )
    def test_a_401_in_arks_shape_saying_why(self, key: MemberKey | None, sent: bool, says: str) -> None:
        """Ark's code for a bad key, so a client that reads the code treats it as it treats Ark's own."""
        answer = refusal(key, sent=sent)
        assert answer.status == 401
        error = json.loads(answer.body)["error"]
        assert set(error) == {"code", "message", "param", "type"}
        assert (error["code"], error["type"]) == ("AuthenticationError", "Unauthorized")
        assert says in error["message"] and "quotawrap keys add" in error["message"]
        assert dict(answer.headers)["x-should-retry"] == "false"
