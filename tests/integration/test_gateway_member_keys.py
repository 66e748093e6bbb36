"""Member keys: a real `quotawrap serve` holding the provider's key, real `openai` clients with member keys, the
real simulator accepting only the provider's key, the `quotawrap keys` commands, on SQLite and on Redis."""

from __future__ import annotations

import json
import re
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from quotawrap.core.member_keys import new_member_key
from quotawrap.ledger import open_ledger
from quotawrap.simulator import ArkSimulator, SimConfig, serve
from tests.conftest import run_cli
from tests.integration.gateway_process import MODEL, gateway
from tests.redis_server import RedisServer, private_server

VARIABLE = "QW_TEST_PROVIDER_KEY"
_PRINTED_KEY = re.compile(r"^(qwk-[A-Za-z0-9_-]{43})$", re.MULTILINE)


class Seen:
    """Every byte quotawrap showed or wrote in one test: command outputs and answers, then the files."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.env = {"XDG_STATE_HOME": str(root / "state"), "HOME": str(root / "home")}  # default files land here
        self.texts: list[str] = []

    def cli(self, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        result = run_cli(*args, env={**self.env, **(env or {})})
        self.texts += [result.stdout, result.stderr]
        return result

    def answer(self, response: httpx.Response) -> httpx.Response:
        self.texts += [response.text, *(f"{name}: {value}" for name, value in response.headers.items())]
        return response

    def files(self, *more: Path) -> dict[Path, bytes]:
        roots = [self.root, *more]
        return {path: path.read_bytes() for root in roots for path in root.rglob("*") if path.is_file()}


@pytest.fixture
def provider_key() -> str:
    return str(uuid.uuid4())  # the form of an Ark API key


@pytest.fixture
def provider(provider_key: str) -> Iterator[ArkSimulator]:
    """The simulator as Ark with one account: any other key is answered 401."""
    with serve(config=SimConfig(api_keys=(provider_key,))) as simulator:
        yield simulator


@pytest.fixture(params=["sqlite", pytest.param("redis", marks=pytest.mark.redis)])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, RedisServer | None]]:
    """(store URL, its redis-server or None); the Redis one keeps an append-only file, searched like any file."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'ledger.sqlite3'}", None
        return
    with private_server(appendonly=True) as server:
        yield server.url, server


def add_key(seen: Seen, store: str, name: str, *tags: str) -> str:
    result = seen.cli("keys", "add", name, *(arg for tag in tags for arg in ("--tag", tag)), "--store", store)
    assert result.returncode == 0, result.stderr
    printed = _PRINTED_KEY.findall(result.stdout)
    assert len(printed) == 1, result.stdout
    return str(printed[0])


def chat(client: openai.OpenAI, content: str, *, stream: bool = False) -> str:
    if stream:
        chunks = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": content}], max_tokens=200, stream=True
        )
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    answer = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": content}], max_tokens=200
    )
    return answer.choices[0].message.content or ""


def refused(seen: Seen, client: openai.OpenAI) -> dict[str, str]:
    """The 401 the gateway gave this client, as the openai package raised it: its error object."""
    with pytest.raises(openai.AuthenticationError) as caught:
        chat(client, "let me in")
    seen.answer(caught.value.response)
    assert caught.value.status_code == 401
    body = caught.value.response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"code", "message", "param", "type"}
    assert (body["error"]["code"], body["error"]["type"]) == ("AuthenticationError", "Unauthorized")
    return dict(body["error"])


def test_members_spend_through_the_provider_key_they_never_hold(
    provider: ArkSimulator, provider_key: str, backend: tuple[str, RedisServer | None], tmp_path: Path
) -> None:
    """Two members' calls go upstream with the provider's key and their own tags; unknown, missing and revoked
    keys get 401 and never reach the provider; neither the provider's key nor a member's appears in any file."""
    store, redis = backend
    seen = Seen(tmp_path)
    ana = add_key(seen, store, "ana", "team=search", "user=ana")
    bob = add_key(seen, store, "bob", "team=infra")
    assert ana != bob
    args = ["--store", store, "--base-url", provider.url, "--upstream-key-env", VARIABLE]
    args += ["--audit-log", str(tmp_path / "audit.jsonl")]
    env = {**seen.env, VARIABLE: provider_key}
    with gateway(args, env=env) as gw:
        members = {
            name: openai.OpenAI(base_url=gw.url, api_key=key, max_retries=0)
            for name, key in (("ana", ana), ("bob", bob))
        }
        assert chat(members["ana"], "one") and chat(members["ana"], "two", stream=True)
        assert chat(members["bob"], "three")

        unknown = refused(seen, openai.OpenAI(base_url=gw.url, api_key=new_member_key(), max_retries=0))
        assert "not a member key" in unknown["message"]
        # the provider's own key is no member key: whoever has it calls the provider, not the gateway
        assert (
            "not a member key"
            in refused(seen, openai.OpenAI(base_url=gw.url, api_key=provider_key, max_retries=0))["message"]
        )
        bare = seen.answer(httpx.post(f"{gw.url}/chat/completions", json={"model": MODEL, "messages": []}, timeout=30))
        assert bare.status_code == 401 and "no member key" in bare.json()["error"]["message"]

        revoked = seen.cli("keys", "revoke", "bob", "--store", store)
        assert revoked.returncode == 0, revoked.stderr
        assert "bob" in refused(seen, members["bob"])["message"]  # the next call, no wait
        assert chat(members["ana"], "four")
        seen.texts.append(gw.start_line)
        code, stderr = gw.terminate()
        seen.texts.append(stderr)
    assert code == 0, stderr

    # Upstream: four calls, each with the provider's key (the simulator takes no other), none of the refused.
    assert provider.calls() == 4
    assert sum(provider.requests_by_path().values()) == 4

    listed = seen.cli("keys", "list", "--json", "--store", store)
    assert listed.returncode == 0, listed.stderr
    keys = {entry["name"]: entry for entry in json.loads(listed.stdout)}
    assert keys["ana"]["tags"] == {"team": "search", "user": "ana"} and keys["ana"]["revoked_at"] is None
    assert keys["bob"]["tags"] == {"team": "infra"} and keys["bob"]["revoked_at"] is not None

    ledger = open_ledger(store)
    try:
        calls = [record for record in ledger.call_records() if record.state != "blocked"]
    finally:
        ledger.close()
    by_key = {name: [c for c in calls if c.tags.get("key") == name] for name in ("ana", "bob")}
    assert len(by_key["ana"]) == 3 and len(by_key["bob"]) == 1 and len(calls) == 4
    for name, team in (("ana", "search"), ("bob", "infra")):
        for call in by_key[name]:
            assert call.tags["team"] == team
            assert call.key_fingerprint == keys[name]["fingerprint"]  # the member's key, not the provider's

    report = seen.cli("report", "--by", "tag:team", "--format", "json", "--store", store)
    assert report.returncode == 0, report.stderr
    rows = {row["key"]: row for row in json.loads(report.stdout)["rows"]}
    assert rows["search"]["calls"] == 3 and rows["infra"]["calls"] == 1
    assert rows["search"]["settled_tokens"] > 0 and rows["infra"]["settled_tokens"] > 0
    for command in (["status"], ["status", "--json"], ["sessions"], ["keys", "list"], ["report", "--by", "tag:key"]):
        assert seen.cli(*command, "--store", store).returncode == 0

    said = "\n".join(seen.texts)
    assert provider_key not in said
    files = seen.files(*([redis.directory] if redis is not None else []))
    assert any(path.name == "audit.jsonl" for path in files)
    if redis is None:
        assert any(path.name == "ledger.sqlite3" for path in files)
    else:  # the append-only file logs every write the ledger made
        assert any("aof" in path.name for path in files)
    for path, data in files.items():
        for secret in (provider_key, ana, bob):
            assert secret.encode() not in data, f"{path} holds a key"


@pytest.mark.redis
def test_a_ledger_that_cannot_answer_lets_no_call_through(
    provider: ArkSimulator, provider_key: str, tmp_path: Path
) -> None:
    """Even under --fail-open: a member key that cannot be checked is a 503, and nothing reaches the provider."""
    seen = Seen(tmp_path)
    with private_server(appendonly=False) as server:
        ana = add_key(seen, server.url, "ana", "team=search")
        args = ["--store", server.url, "--base-url", provider.url, "--upstream-key-env", VARIABLE, "--fail-open"]
        with gateway(args, env={**seen.env, VARIABLE: provider_key}) as gw:
            server.stop()
            client = openai.OpenAI(base_url=gw.url, api_key=ana, max_retries=0)
            with pytest.raises(openai.InternalServerError) as caught:
                chat(client, "while the ledger is away")
            _code, stderr = gw.terminate()
    assert caught.value.status_code == 503
    assert caught.value.response.json()["error"]["code"] == "QuotawrapStoreUnavailable"
    assert sum(provider.requests_by_path().values()) == 0
    assert provider_key not in stderr + caught.value.response.text


def test_serve_refuses_to_start_without_the_provider_key(provider: ArkSimulator, store: str, tmp_path: Path) -> None:
    """A variable that is not set, or a key passed where its variable's name belongs: exit 2, the key unshown."""
    seen = Seen(tmp_path)
    base = ["serve", "--port", "0", "--store", store, "--base-url", provider.url]
    unset = seen.cli(*base, "--upstream-key-env", VARIABLE)
    assert unset.returncode == 2 and VARIABLE in unset.stderr and "is not set" in unset.stderr
    assert len(unset.stderr.strip().splitlines()) == 1, unset.stderr
    key = str(uuid.uuid4())
    given = seen.cli(*base, "--upstream-key-env", key)
    assert given.returncode == 2 and "name of an environment variable" in given.stderr
    assert key not in given.stderr


def test_keys_commands_refuse_bad_input_in_one_line(store: str, tmp_path: Path) -> None:
    seen = Seen(tmp_path)
    add_key(seen, store, "ana", "team=search")
    for args, says in (
        (["keys", "add", "ana"], "already"),
        (["keys", "add", "ana bob"], "letters, digits"),
        (["keys", "add", "cleo", "--tag", "key=cleo"], "key=NAME"),
        (["keys", "add", "cleo", "--tag", "team"], "KEY=VALUE"),
        (["keys", "revoke", "nobody"], "no member key named 'nobody'"),
    ):
        result = seen.cli(*args, "--store", store)
        assert result.returncode == 2, (args, result.stderr)
        assert says in result.stderr and len(result.stderr.strip().splitlines()) == 1, (args, result.stderr)
    twice = [seen.cli("keys", "revoke", "ana", "--store", store) for _ in range(2)]
    assert [r.returncode for r in twice] == [0, 0]
    assert "already revoked" in twice[1].stdout
    listed = seen.cli("keys", "list", "--store", store)
    assert "ana" in listed.stdout and "revoked" in listed.stdout and "team=search" in listed.stdout


def test_a_gateway_without_the_provider_key_stays_transparent(sim: ArkSimulator, store: str, tmp_path: Path) -> None:
    """Keys in the ledger change nothing for a gateway that does not hold the provider's key: callers bring theirs."""
    seen = Seen(tmp_path)
    add_key(seen, store, "ana", "team=search")
    with gateway(["--store", store, "--base-url", sim.url], env=seen.env) as gw:
        client = openai.OpenAI(base_url=gw.url, api_key="sk-callers-own", max_retries=0)
        assert chat(client, "hello")
    assert sim.calls() == 1
