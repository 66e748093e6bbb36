"""Issue 8's acceptance agent: every Python HTTP stack, plain and streamed, plus Ark's other endpoints.

First the endpoints of endpoints_agent.py (images, a video task polled to its end, a context create, batch chat,
an unknown POST path), then rounds of chat calls through httpx, openai (httpx2, plain and streamed), requests,
aiohttp, urllib.request and http.client (plain and streamed) until a whole round is refused or ROUNDS run out.
Prints one JSON line per endpoint step (see endpoints_agent.py) and one per chat call: {"stack", "status", "total"}.
SIM_URL is the Ark base URL; MAX_TOKENS each chat's max_tokens.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import sys
import urllib.error
import urllib.request
from collections.abc import Callable
from urllib.parse import urlsplit

import aiohttp
import endpoints_agent  # a sibling child: its steps, not a copy of them
import httpx
import openai
import requests

URL = os.environ["SIM_URL"].rstrip("/") + "/chat/completions"
HEADERS = {"Authorization": "Bearer sk-test", "Content-Type": "application/json"}
ROUNDS = 40


def body(stream: bool) -> dict[str, object]:
    return {
        "model": "deepseek-v4-flash",
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": int(os.environ.get("MAX_TOKENS", "2000")),
        "stream": stream,
    }


def usage_total(status: int, text: str, stream: bool) -> int | None:
    """The usage total of a JSON answer or of an SSE stream's last usage event."""
    if status != 200:
        return None
    if not stream:
        return int(json.loads(text)["usage"]["total_tokens"])
    usage = None
    for line in text.splitlines():
        if line.startswith("data: {"):
            usage = json.loads(line[6:]).get("usage") or usage
    return usage and int(usage["total_tokens"])


def via_httpx(stream: bool) -> tuple[int, str]:
    with httpx.Client() as client, client.stream("POST", URL, json=body(stream), headers=HEADERS) as resp:
        return resp.status_code, resp.read().decode()


def via_openai(stream: bool) -> tuple[int, str]:
    client = openai.OpenAI(base_url=os.environ["SIM_URL"], api_key="sk-test", max_retries=0)
    try:
        if not stream:
            answer = client.chat.completions.create(**body(False))  # type: ignore[call-overload]
            return 200, answer.model_dump_json()
        chunks = client.chat.completions.create(**body(True), stream_options={"include_usage": True})  # type: ignore[call-overload]
        return 200, "\n".join(f"data: {chunk.model_dump_json()}" for chunk in chunks)
    except openai.APIStatusError as exc:
        return exc.status_code, str(exc)


def via_requests(stream: bool) -> tuple[int, str]:
    resp = requests.post(URL, json=body(stream), headers=HEADERS, stream=stream)
    text = "".join(line.decode() + "\n" for line in resp.iter_lines()) if stream else resp.text
    return resp.status_code, text


def via_aiohttp(stream: bool) -> tuple[int, str]:
    async def main() -> tuple[int, str]:
        async with aiohttp.ClientSession() as session, session.post(URL, json=body(stream), headers=HEADERS) as resp:
            if stream:
                return resp.status, b"".join([chunk async for chunk in resp.content.iter_any()]).decode()
            return resp.status, await resp.text()

    return asyncio.run(main())


def via_urllib(stream: bool) -> tuple[int, str]:
    request = urllib.request.Request(URL, data=json.dumps(body(stream)).encode(), headers=HEADERS, method="POST")
    try:
        with urllib.request.urlopen(request) as resp:
            return resp.status, "".join(line.decode() for line in resp) if stream else resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def via_http_client(stream: bool) -> tuple[int, str]:
    parts = urlsplit(URL)
    conn = http.client.HTTPConnection(parts.hostname or "", parts.port)
    conn.request("POST", parts.path, json.dumps(body(stream)).encode(), HEADERS)
    resp = conn.getresponse()
    text = "".join(line.decode() for line in resp) if stream else resp.read().decode()
    conn.close()
    return resp.status, text


STACKS: dict[str, Callable[[bool], tuple[int, str]]] = {
    "httpx": via_httpx,
    "openai": via_openai,
    "requests": via_requests,
    "aiohttp": via_aiohttp,
    "urllib": via_urllib,
    "http.client": via_http_client,
}


def chat_rounds() -> None:
    for _ in range(ROUNDS):
        refused = 0
        for name, call in STACKS.items():
            for stream in (False, True):
                status, text = call(stream)
                refused += status != 200
                record = {"stack": name + ("-stream" if stream else ""), "status": status}
                print(json.dumps({**record, "total": usage_total(status, text, stream)}), flush=True)
        if refused == 2 * len(STACKS):
            return


if __name__ == "__main__":
    for step in ("images", "video", "context", "batch", "unknown"):
        endpoints_agent.STEPS[step]()
    chat_rounds()
    sys.exit(0)
