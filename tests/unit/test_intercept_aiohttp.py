"""Tests for quotawrap.intercept.aiohttp_adapter against the real in-process Ark simulator."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterator
from typing import Any

import aiohttp
import httpx2
import openai
import pytest

from quotawrap.admission.guard import Guard
from quotawrap.intercept import aiohttp_adapter, httpx_adapter
from quotawrap.simulator import ArkSimulator
from tests.conftest import ledger_rows

MODEL = "doubao-seed-1-6-250615"
HEADERS = {"Authorization": "Bearer sk-test"}


def _chat(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 64, **extra}


@pytest.fixture(autouse=True)
def patched() -> Iterator[None]:
    """aiohttp and httpx2 patched for the test (and left as they were found)."""
    was = getattr(aiohttp.ClientSession, "_quotawrap_patched", False)
    was2 = getattr(httpx2, "_quotawrap_patched", False)
    aiohttp_adapter.patch(aiohttp)
    httpx_adapter.patch(httpx2)
    yield
    if not was:
        aiohttp_adapter.unpatch(aiohttp)
    if not was2:
        httpx_adapter.unpatch(httpx2)


def _rows(store: str) -> list[tuple[Any, ...]]:
    return ledger_rows(store, "SELECT state, charged FROM calls")


def test_lines_of_a_stream_settle_it_and_hide_the_injected_usage(guard: Guard, sim: ArkSimulator, store: str) -> None:
    """`async for line in resp.content`: every line as sent, but the usage-only chunk we asked for."""

    async def main() -> list[bytes]:
        async with (
            aiohttp.ClientSession() as session,
            session.post(sim.url + "/chat/completions", json=_chat(stream=True), headers=HEADERS) as resp,
        ):
            return [line async for line in resp.content]

    lines = asyncio.run(main())
    assert lines[-2:] == [b"data: [DONE]\n", b"\n"]
    assert not any(line.startswith(b"data: {") and json.loads(line[6:])["choices"] == [] for line in lines)
    assert _rows(store) == [("settled", sim.billed_total())]


def test_releasing_a_stream_early_charges_its_hold(guard: Guard, sim: ArkSimulator, store: str) -> None:
    """A stream left after its first line is abandoned: the whole hold is charged (unresolved)."""

    async def main() -> None:
        async with aiohttp.ClientSession() as session:
            sim.configure(chunk_delay_s=0.05)
            async with session.post(sim.url + "/chat/completions", json=_chat(stream=True), headers=HEADERS) as resp:
                await resp.content.readline()

    asyncio.run(main())
    ((state, charged),) = _rows(store)
    assert state == "unresolved" and charged > 0


def test_raise_for_status_raises_on_a_refusal_with_quotawrap_s_message(
    make_guard: Callable[..., Guard], sim: ArkSimulator
) -> None:
    """A session with raise_for_status=True gets ClientResponseError(429) whose message names the limit."""
    make_guard(cap_tokens=10)

    async def main() -> None:
        async with aiohttp.ClientSession(raise_for_status=True) as session:
            await session.post(sim.url + "/chat/completions", json=_chat(), headers=HEADERS)

    with pytest.raises(aiohttp.ClientResponseError) as caught:
        asyncio.run(main())
    assert caught.value.status == 429 and "run_cap" in caught.value.message
    assert sim.calls() == 0


def test_openai_over_aiohttp_is_reserved_once(guard: Guard, sim: ArkSimulator, store: str) -> None:
    """openai's aiohttp transport under httpx2: the httpx2 seam guards, the aiohttp seam stands aside."""

    async def main() -> int:
        async with openai.AsyncOpenAI(
            base_url=sim.url, api_key="sk-test", http_client=openai.DefaultAioHttpClient(), max_retries=0
        ) as client:
            answer = await client.chat.completions.create(**_chat())
            assert answer.usage is not None
            return answer.usage.total_tokens

    total = asyncio.run(main())
    assert _rows(store) == [("settled", total)]
