"""One chat call through the HTTP stack named on the command line; prints one JSON record.

Stacks: aiohttp, aiohttp-stream, urllib, http.client, http.client-stream, urllib3,
urllib3-stream, requests-adapter-subclass, httpx-transport. The record says the HTTP status
and, when the answer carried it, its usage total (a stream's last usage event).
"""

from __future__ import annotations

import json
import os
import sys
from urllib.parse import urlsplit

URL = os.environ["SIM_URL"].rstrip("/") + "/chat/completions"
STACK = sys.argv[1]
STREAM = STACK.endswith("-stream")
BODY = {
    "model": os.environ.get("MODEL", "deepseek-v4-flash"),
    "messages": [{"role": "user", "content": "hello"}],
    "max_tokens": int(os.environ.get("MAX_TOKENS", "100")),
    "stream": STREAM,
}
if STREAM and os.environ.get("ASK_USAGE"):
    BODY["stream_options"] = {"include_usage": True}
HEADERS = {"Authorization": "Bearer sk-test", "Content-Type": "application/json"}
RAW = json.dumps(BODY).encode()


def total(status: int, text: str) -> dict[str, object]:
    """The usage total of a JSON answer or of an SSE stream's last usage event."""
    usage = None
    if STREAM and status == 200:
        for line in text.splitlines():
            if line.startswith("data: {"):
                usage = json.loads(line[6:]).get("usage") or usage
    else:
        usage = json.loads(text).get("usage") if text.startswith("{") else None
    error = json.loads(text).get("error", {}).get("message") if status >= 400 else None
    return {"stack": STACK, "status": status, "total": usage and usage["total_tokens"], "error": error}


def via_aiohttp() -> dict[str, object]:
    import asyncio

    import aiohttp

    async def main() -> dict[str, object]:
        async with aiohttp.ClientSession() as session, session.post(URL, json=BODY, headers=HEADERS) as resp:
            if STREAM and resp.status == 200:
                pieces = [chunk async for chunk in resp.content.iter_any()]
                return total(resp.status, b"".join(pieces).decode())
            return total(resp.status, await resp.text())

    return asyncio.run(main())


def via_aiohttp_swarm() -> dict[str, object]:
    """24 calls at once on one session, every other one streamed: one status per call."""
    import asyncio

    import aiohttp

    async def one(session: aiohttp.ClientSession, stream: bool) -> int:
        async with session.post(URL, json={**BODY, "stream": stream}, headers=HEADERS) as resp:
            if stream:
                async for _chunk in resp.content.iter_any():
                    pass
            else:
                await resp.read()
            return resp.status

    async def main() -> list[int]:
        async with aiohttp.ClientSession() as session:
            return await asyncio.gather(*(one(session, n % 2 == 1) for n in range(24)))

    return {"stack": STACK, "statuses": asyncio.run(main())}


def via_urllib() -> dict[str, object]:
    import urllib.error
    import urllib.request

    request = urllib.request.Request(URL, data=RAW, headers=HEADERS, method="POST")
    try:
        with urllib.request.urlopen(request) as resp:
            return total(resp.status, resp.read().decode())
    except urllib.error.HTTPError as exc:
        return total(exc.code, exc.read().decode())


def via_http_client() -> dict[str, object]:
    import http.client

    parts = urlsplit(URL)
    conn = http.client.HTTPConnection(parts.hostname, parts.port)
    conn.request("POST", parts.path, RAW, HEADERS)
    resp = conn.getresponse()
    # a stream line by line, as an SSE reader does
    text = "".join(line.decode() for line in resp) if STREAM and resp.status == 200 else resp.read().decode()
    conn.close()
    return total(resp.status, text)


def via_urllib3() -> dict[str, object]:
    import urllib3

    pool = urllib3.PoolManager()
    if STREAM:
        resp = pool.request("POST", URL, body=RAW, headers=HEADERS, preload_content=False)
        text = b"".join(resp.stream(1024)).decode()
        resp.release_conn()
        return total(resp.status, text)
    resp = pool.request("POST", URL, body=RAW, headers=HEADERS)
    return total(resp.status, resp.data.decode())


def via_requests_adapter_subclass() -> dict[str, object]:
    import requests
    from requests.adapters import HTTPAdapter

    class Logging(HTTPAdapter):
        def send(self, request, *args, **kwargs):  # type: ignore[no-untyped-def]
            # A subclass that does the work itself, below the patched HTTPAdapter.send.
            conn = self.get_connection_with_tls_context(request, kwargs.get("verify", True))
            raw = conn.urlopen(
                method=request.method,
                url=self.request_url(request, {}),
                body=request.body,
                headers=request.headers,
                redirect=False,
                preload_content=False,
                decode_content=False,
            )
            return self.build_response(request, raw)

    session = requests.Session()
    session.mount("http://", Logging())
    resp = session.post(URL, data=RAW, headers=HEADERS)
    return total(resp.status_code, resp.text)


def via_httpx_transport() -> dict[str, object]:
    import httpx

    transport = httpx.HTTPTransport()
    request = httpx.Request("POST", URL, content=RAW, headers=HEADERS)
    resp = transport.handle_request(request)
    text = b"".join(resp.stream).decode()  # type: ignore[union-attr]
    resp.close()
    return total(resp.status_code, text)


STACKS = {
    "aiohttp": via_aiohttp,
    "aiohttp-stream": via_aiohttp,
    "aiohttp-swarm": via_aiohttp_swarm,
    "urllib": via_urllib,
    "http.client": via_http_client,
    "http.client-stream": via_http_client,
    "urllib3": via_urllib3,
    "urllib3-stream": via_urllib3,
    "requests-adapter-subclass": via_requests_adapter_subclass,
    "httpx-transport": via_httpx_transport,
}

if __name__ == "__main__":
    print(json.dumps(STACKS[STACK]()), flush=True)
