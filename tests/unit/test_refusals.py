"""Tests for quotawrap.admission.refusals: refusals remembered for retries, redirects remembered for the next hop."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading

from quotawrap.admission.refusals import RedirectMemory, RetryMemory, caller, fingerprint, unknown_path_message
from quotawrap.core.endpoints import Route

CHAT = Route("guard", "/api/v3/chat/completions", "chat", "chat")


class TestFingerprint:
    def test_method_url_and_body_all_count(self) -> None:
        """Requests differing in any of method, URL or body are different requests."""
        base = fingerprint("POST", "http://h/a", b"{}")
        assert base == fingerprint("post", "http://h/a", b"{}")
        assert len({base, fingerprint("PUT", "http://h/a", b"{}"), fingerprint("POST", "http://h/b", b"{}")}) == 3
        assert base != fingerprint("POST", "http://h/a", b"{ }")

    def test_the_caller_counts(self) -> None:
        """The same request from another thread or task is another call, not a retry."""
        assert fingerprint("POST", "http://h/a", b"{}", "1/0") != fingerprint("POST", "http://h/a", b"{}", "2/0")

    def test_parts_cannot_run_into_each_other(self) -> None:
        """Moving bytes between URL and body changes the fingerprint."""
        assert fingerprint("POST", "http://h/ab", b"c") != fingerprint("POST", "http://h/a", b"bc")


class TestRetryMemory:
    def test_empty_until_a_refusal_is_remembered(self) -> None:
        """The guard fingerprints a request (a hash of its body) only when some refusal is remembered."""
        memory = RetryMemory(window_s=10)
        assert not memory
        memory.remember("k", "answer", now=100.0)
        assert memory

    def test_a_retry_within_the_window_gets_the_same_answer_and_a_count(self) -> None:
        """The first retry is retry 1, the next retry 2; the process total counts both."""
        memory = RetryMemory(window_s=10)
        memory.remember("k", "answer", now=100.0)
        assert memory.recall("k", now=101.0) == ("answer", 1)
        assert memory.recall("k", now=109.0) == ("answer", 2)
        assert memory.retries == 2

    def test_after_the_window_the_request_is_checked_afresh(self) -> None:
        """A hold may have settled since: past the window the memory lets the request be re-checked."""
        memory = RetryMemory(window_s=10)
        memory.remember("k", "answer", now=100.0)
        assert memory.recall("k", now=110.0) is None
        assert memory.recall("k", now=110.5) is None

    def test_other_requests_are_not_recalled(self) -> None:
        """Only an identical request is answered from memory."""
        memory = RetryMemory()
        memory.remember("k", "answer", now=0.0)
        assert memory.recall("other", now=0.0) is None

    def test_memory_is_bounded(self) -> None:
        """However many refusals, the memory keeps the newest few hundred."""
        memory = RetryMemory()
        for index in range(1000):
            memory.remember(str(index), "answer", now=0.0)
        assert memory.recall("0", now=0.0) is None
        assert memory.recall("999", now=0.0) == ("answer", 1)

    def test_closing_reports_the_retries_now_and_not_again_at_exit(self) -> None:
        """A guard done with (a test's, an embedder's) says its count once, when closed, not from the exit;
        one left open says it at the exit, as a guarded program's does."""
        script = """
import sys
from dataclasses import dataclass
from quotawrap.admission.refusals import RetryMemory, unreported_retries

@dataclass(frozen=True)
class Answer:
    headers: tuple = ()

memory = RetryMemory(window_s=10)
memory.remember("k", Answer(), now=0.0)
assert memory.answer("k", now=1.0) and memory.answer("k", now=2.0) and unreported_retries() == 1
if sys.argv[1] == "close":
    memory.close()
    memory.close()  # twice says nothing more
    assert unreported_retries() == 0
print("END", file=sys.stderr, flush=True)
"""
        for how, before_end, after_end in (("close", 1, 0), ("leave", 0, 1)):
            done = subprocess.run(
                [sys.executable, "-c", script, how], capture_output=True, text=True, timeout=60, check=True
            )
            before, _, after = done.stderr.partition("END")
            said = "2 identical retries of refused requests were answered from memory"
            assert (before.count(said), after.count(said)) == (before_end, after_end), (how, done.stderr)


class TestRedirectMemory:
    def test_the_next_hop_of_a_redirected_post_is_routed_like_the_call(self) -> None:
        """A relative or absolute Location is remembered, compared by origin and path."""
        now = [0.0]
        memory = RedirectMemory(lambda: now[0], window_s=60)
        memory.note("http://a:1/api/v3/chat/completions", "http://B:80/v3/chat/completions/", CHAT)
        assert memory.route_for("POST", "http://b/v3/chat/completions") == CHAT
        memory.note("http://a:1/api/v3/chat/completions", "/other/path", CHAT)
        assert memory.route_for("POST", "http://a:1/other/path") == CHAT

    def test_a_get_after_a_303_is_not_a_billed_call(self) -> None:
        """A client that turns the POST into a GET sends nothing billable."""
        memory = RedirectMemory(lambda: 0.0)
        memory.note("http://a/x", "http://b/y", CHAT)
        assert memory.route_for("GET", "http://b/y") is None

    def test_targets_expire(self) -> None:
        """A redirect not followed within the window is forgotten."""
        now = [0.0]
        memory = RedirectMemory(lambda: now[0], window_s=60)
        memory.note("http://a/x", "http://b/y", CHAT)
        now[0] = 61.0
        assert memory.route_for("POST", "http://b/y") is None


def test_unknown_path_message_names_the_path_and_the_cure() -> None:
    """The refusal names the method, the path, the flag and its variable."""
    message = unknown_path_message("post", "/api/v3/audio/speech")
    assert "POST /api/v3/audio/speech" in message
    assert "--allow-path /api/v3/audio/speech" in message and "QUOTAWRAP_ALLOW_PATH" in message


class TestCaller:
    def test_threads_differ(self) -> None:
        """Two threads are two callers; one thread asking twice is one."""
        seen: list[str] = []
        thread = threading.Thread(target=lambda: seen.append(caller()))
        thread.start()
        thread.join()
        assert caller() == caller() != seen[0]

    def test_tasks_differ(self) -> None:
        """Two asyncio tasks running at once are two callers; one task asking twice is one."""

        async def ask() -> tuple[str, str]:
            first = caller()
            await asyncio.sleep(0)
            return first, caller()

        async def both() -> list[tuple[str, str]]:
            return list(await asyncio.gather(ask(), ask()))

        (a1, a2), (b1, b2) = asyncio.run(both())
        assert a1 == a2 and b1 == b2 and a1 != b1
