"""The gateway's pure header, URL and tag rules (quotawrap/serve/_http.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from quotawrap.core.errors import ConfigError
from quotawrap.serve._http import (
    PROXY_VARIABLES,
    forwarded_request_headers,
    forwarded_response_headers,
    header_tags,
    proxy_environment,
    upstream_url,
)


class TestUpstreamUrl:
    @pytest.mark.parametrize(
        ("base", "path", "query", "expected"),
        [
            ("http://h:1/api/v3", "/chat/completions", "", "http://h:1/api/v3/chat/completions"),
            ("http://h:1/api/v3/", "/chat/completions", "", "http://h:1/api/v3/chat/completions"),
            ("https://api.example/v1", "/responses/r1", "a=1&b=%20", "https://api.example/v1/responses/r1?a=1&b=%20"),
            ("http://h:1", "/", "", "http://h:1/"),
        ],
    )
    def test_gateway_root_stands_for_the_upstream_base(self, base: str, path: str, query: str, expected: str) -> None:
        """Path and raw query are appended to the base exactly once, whatever its trailing slash."""
        assert upstream_url(base, path, query) == expected


class TestRequestHeaders:
    def test_keeps_the_callers_headers_and_drops_the_hop_and_ours(self) -> None:
        """Authorization and repeated headers go upstream; hop-by-hop, Host, length and the tag header do not."""
        headers = [
            ("Host", "127.0.0.1:8790"),
            ("Authorization", "Bearer sk-1"),
            ("Connection", "keep-alive, X-Private"),
            ("X-Private", "x"),
            ("Keep-Alive", "timeout=5"),
            ("Content-Length", "10"),
            ("Transfer-Encoding", "chunked"),
            ("X-Quotawrap-Tag", "user=alice"),
            ("Accept", "a"),
            ("Accept", "b"),
        ]
        assert forwarded_request_headers(headers) == [
            ("Authorization", "Bearer sk-1"),
            ("Accept", "a"),
            ("Accept", "b"),
        ]


class TestResponseHeaders:
    def test_length_kept_only_when_the_body_passes_unchanged(self) -> None:
        """A stream whose usage chunk the guard hides changes length; a JSON body does not."""
        headers = [("Content-Type", "x"), ("Content-Length", "5"), ("Transfer-Encoding", "chunked"), ("Server", "s")]
        assert forwarded_response_headers(headers, keep_length=True) == [
            ("Content-Type", "x"),
            ("Content-Length", "5"),
            ("Server", "s"),
        ]
        assert forwarded_response_headers(headers, keep_length=False) == [("Content-Type", "x"), ("Server", "s")]


class TestHeaderTags:
    def test_comma_separated_and_repeated_headers(self) -> None:
        """Several headers and comma lists merge; a repeated key's last value wins."""
        assert header_tags(["user=alice, team=infra", "team=ml"]) == {"user": "alice", "team": "ml"}

    def test_none_is_no_tag(self) -> None:
        """No header (or an empty one) adds nothing."""
        assert header_tags([]) == {} and header_tags([" , "]) == {}

    @pytest.mark.parametrize("bad", ["alice", "user=", "us er=alice"])
    def test_a_malformed_tag_is_refused_with_its_reason(self, bad: str) -> None:
        """The gateway answers 400 with this message rather than guessing."""
        with pytest.raises(ConfigError, match=r"KEY=VALUE|empty|key must"):
            header_tags([bad])


def test_proxy_environment_sets_every_documented_variable() -> None:
    """Each variable --proxy sets points at the gateway, and docs/gateway.md names each one."""
    env = proxy_environment("http://127.0.0.1:5000")
    assert set(env) == {name for name, _ in PROXY_VARIABLES} >= {"OPENAI_BASE_URL", "ARK_BASE_URL"}
    assert set(env.values()) == {"http://127.0.0.1:5000"}
    doc = (Path(__file__).resolve().parents[2] / "docs" / "gateway.md").read_text()
    assert all(f"`{name}`" in doc for name in env)
