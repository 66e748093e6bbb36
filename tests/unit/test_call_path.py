"""One guarded call's path through quotawrap: each file is entered from at most two places, and nothing calls back
into the guard (docs/internals.md, "One call's path").

A guarded chat call goes through the real httpx adapter (httpx's transport mocked by respx) while
``sys.setprofile`` records every call into a quotawrap file from another file. What counts as entering a file:

* a call from another quotawrap file; httpx calling the adapter's seams (the send, the body's iterator, its
  close) drives the path, and is not part of it;
* into a module that is not pure (``check_imports.pure_modules``): a pure function keeps no state and calls
  nothing back, so it is a leaf wherever it is called from;
* from outside the ledger package into it, or within the rest: the store's own files are one service to the
  path, entered by the reserve and the settle;
* once per calling file: a file that calls several of another's functions in its turn hands the path over once.
"""

from __future__ import annotations

import collections
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import httpx
import pytest
import respx

import quotawrap
from quotawrap.admission.guard import Guard
from quotawrap.config.settings import Settings
from quotawrap.intercept import httpx_adapter, set_guard
from tests.check_imports import module_names, pure_modules

BASE = "http://testserver/api/v3"
MODEL = "doubao-seed-1-6-250615"
ANSWER = {
    "id": "0217abc",
    "object": "chat.completion",
    "model": MODEL,
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hi"}, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 9, "completion_tokens": 3, "total_tokens": 12},
}
PACKAGE = Path(quotawrap.__file__).parent
Call = tuple[str | None, str]  # (the calling file, None outside quotawrap; the file called), relative to the package


def _pure_files() -> set[str]:
    names = module_names(PACKAGE)
    return {str(names[name].relative_to(PACKAGE)) for name in pure_modules(names)}


def _relative(filename: str) -> str | None:
    path = Path(filename)
    return str(path.relative_to(PACKAGE)) if path.is_relative_to(PACKAGE) else None


def traced_calls(run: Callable[[], Any]) -> list[Call]:
    """Every call into a quotawrap file from another file while ``run`` runs on this thread."""
    calls: list[Call] = []

    def profile(frame: FrameType, event: str, _arg: object) -> None:
        if event != "call":
            return
        called = _relative(frame.f_code.co_filename)
        caller = frame.f_back.f_code.co_filename if frame.f_back is not None else ""
        if called is not None and caller != frame.f_code.co_filename:
            calls.append((_relative(caller), called))

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return calls


def entries(calls: list[Call], pure: set[str]) -> dict[str, set[str]]:
    """Each file the path enters, and the files it is entered from (see the module's docstring)."""
    found: dict[str, set[str]] = collections.defaultdict(set)
    for caller, called in calls:
        if caller is None or called in pure:
            continue
        if caller.startswith("ledger/") and called.startswith("ledger/"):
            continue
        found[called].add(caller)
    return found


@pytest.fixture(params=[{"max_tokens": 50}, {}], ids=["max_tokens", "bounded by the guard"])
def chat(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Callable[[], httpx.Response]]:
    """One chat call through the httpx adapter to a guard over a private ledger, answered by respx: with the
    caller's max_tokens, or without (the guard reads its learned reasoning and sends its own bound)."""
    was_patched = getattr(httpx, "_quotawrap_patched", False)
    httpx_adapter.patch(httpx)
    guard = Guard(Settings(store=f"sqlite:///{tmp_path / 'ledger.sqlite3'}", base_url=(BASE,)))
    set_guard(guard)
    try:
        with respx.mock(assert_all_called=True) as router, httpx.Client() as client:
            router.post(BASE + "/chat/completions").respond(200, json=ANSWER)
            body = {"model": MODEL, "messages": [{"role": "user", "content": "Say hi"}], **request.param}

            def call() -> httpx.Response:
                response = client.post(BASE + "/chat/completions", json=body, headers={"Authorization": "Bearer k"})
                response.read()
                return response

            yield call
    finally:
        set_guard(None)
        guard.retries.close()
        if not was_patched:
            httpx_adapter.unpatch(httpx)


def test_a_guarded_call_enters_each_file_from_at_most_two_places(chat: Callable[[], httpx.Response]) -> None:
    chat()  # the first call opens the ledger, reads the price table, loads the tokenizer: not the path
    answers: list[httpx.Response] = []
    calls = traced_calls(lambda: answers.append(chat()))
    assert answers[0].json()["usage"] == ANSWER["usage"]
    found = entries(calls, _pure_files())
    # the path was traced: the adapter handed it to the guard, and the ledger was asked (reserve and settle)
    assert "intercept/httpx_adapter.py" in found["admission/guard.py"]
    assert any(file.startswith("ledger/") for file in found)
    literal = collections.Counter(called for _caller, called in calls)
    report = "\n".join(f"{file}: from {sorted(callers)} ({literal[file]} calls in)" for file, callers in found.items())
    assert all(len(callers) <= 2 for callers in found.values()), report


def test_nothing_calls_back_into_the_guard(chat: Callable[[], httpx.Response]) -> None:
    """Only the adapter enters the guard: its admission and its settle never call it back."""
    chat()
    calls = traced_calls(chat)
    into_guard = {caller for caller, called in calls if called == "admission/guard.py" and caller is not None}
    assert into_guard == {"intercept/httpx_adapter.py"}
