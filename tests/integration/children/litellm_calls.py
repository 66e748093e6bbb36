"""LLM calls made through litellm the way its users write them, run under quotawrap by test_litellm.

Prints one JSON line per call: what litellm handed back (outcome, usage; a stream's chunk count,
text and chunks; or the RateLimitError litellm raised). Then one ``{"carriers": [...]}`` line naming
the HTTP client objects that carried the requests (``httpx.Client/HTTPTransport``,
``httpx.AsyncClient/LiteLLMAiohttpTransport``, ``aiohttp.ClientSession``, ...), and one
``{"egress": [...]}`` line listing every non-loopback host the program tried to resolve or reach
(refused; expected empty).

Modes (``--mode``):
  mix      sync completion and sync stream, then ``--calls`` acompletions at once (half of them
           streams), each through ``openai/`` (litellm's OpenAI route) and ``volcengine/`` (its
           Ark route); non-streamed calls report their usage
  swarm    ``--calls`` concurrent workers (``openai/`` and ``volcengine/`` alternately), each making
           acompletions one after another until blocked or ``--max-calls``; litellm's defaults
           otherwise (a 429 marked ``x-should-retry: false`` is not retried)
  stream   one sync and one async stream that do not ask for usage
  aiohttp  one acompletion through litellm's ``aiohttp_openai/`` provider
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import socket
import sys
from collections.abc import Callable
from typing import Any

# Before litellm is imported: at import it fetches its model cost map from raw.githubusercontent.com
# (and later other catalogs, e.g. Anthropic beta headers) unless told to use its bundled copies.
os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"
os.environ["LITELLM_OFFLINE_MODE"] = "true"

URL = os.environ["SIM_URL"]
MODEL = os.environ.get("MODEL", "deepseek-v4-flash")
VOLATILE = {"id", "created", "system_fingerprint"}
_LOOPBACK = {"127.0.0.1", "::1", "localhost", b"127.0.0.1", b"::1", b"localhost", None}
_egress: list[str] = []
_carriers: set[str] = set()


def _refuse_egress(event: str, args: tuple[Any, ...]) -> None:
    """Record and refuse any resolve or connect that would leave this machine."""
    if event == "socket.getaddrinfo":
        host = args[0]
    elif event == "socket.connect" and isinstance(args[1], tuple):
        host = args[1][0]
    else:
        return
    if host not in _LOOPBACK:
        _egress.append(f"{event} {host!r}")
        raise PermissionError(f"test child: no network beyond loopback ({host!r})")


sys.addaudithook(_refuse_egress)
socket.setdefaulttimeout(60)

import aiohttp  # noqa: E402
import httpx  # noqa: E402
import litellm  # noqa: E402  (the environment above must be in place first)
from litellm.exceptions import RateLimitError  # noqa: E402  (what a 429 becomes, openai.RateLimitError's subclass)

litellm.suppress_debug_info = True
litellm.success_callback = []
litellm.failure_callback = []
litellm.callbacks = []


def _carrier_name(client: Any, request: Any) -> str:
    name = f"{type(client).__module__.split('.')[0]}.{type(client).__name__}"
    transport_for_url = getattr(client, "_transport_for_url", None)
    return f"{name}/{type(transport_for_url(request.url)).__name__}" if transport_for_url else name


def _trace(cls: type, method: str) -> None:
    """Note which client object carried each request (public ``send``; quotawrap wraps a private one)."""
    original: Callable[..., Any] = getattr(cls, method)
    if asyncio.iscoroutinefunction(original):

        @functools.wraps(original)
        async def traced_async(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
            _carriers.add(_carrier_name(self, request))
            return await original(self, request, *args, **kwargs)

        setattr(cls, method, traced_async)
    else:

        @functools.wraps(original)
        def traced(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
            _carriers.add(_carrier_name(self, request))
            return original(self, request, *args, **kwargs)

        setattr(cls, method, traced)


_trace(httpx.Client, "send")
_trace(httpx.AsyncClient, "send")
_trace(aiohttp.ClientSession, "_request")
try:
    import httpx2  # the openai SDK's own client, should litellm ever stop passing its httpx one
except ImportError:
    pass
else:
    _trace(httpx2.Client, "send")
    _trace(httpx2.AsyncClient, "send")


def emit(**record: object) -> None:
    # One write(2) per line: lines of concurrent tasks never interleave.
    os.write(1, (json.dumps(record, ensure_ascii=False) + "\n").encode())


def request(route: str, n: int, args: argparse.Namespace, *, stream: bool) -> dict[str, Any]:
    no_thinking = {"type": "disabled"}
    return {
        "model": f"{route}/{MODEL}",
        "api_base": URL,
        "api_key": "sk-test",
        "messages": [{"role": "user", "content": f"call {n}: say something"}],
        "max_tokens": args.max_tokens,
        "stream": stream,
        # litellm's Ark route knows Ark's `thinking` and moves it into the body; its OpenAI route
        # rejects parameters it does not know, so there it rides in extra_body as users pass it.
        **({"thinking": no_thinking} if route == "volcengine" else {"extra_body": {"thinking": no_thinking}}),
    }


def usage_of(answer: Any) -> dict[str, int] | None:
    usage = getattr(answer, "usage", None)
    if usage is None:
        return None
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
    }


def scrub(data: object) -> object:
    if isinstance(data, dict):
        return {key: scrub(value) for key, value in data.items() if key not in VOLATILE}
    if isinstance(data, list):
        return [scrub(value) for value in data]
    return data


def stream_record(chunks: list[Any]) -> dict[str, Any]:
    return {
        "chunks": len(chunks),
        "text": "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices),
        "usage": [usage for usage in map(usage_of, chunks) if usage is not None],
        "dumps": [scrub(chunk.model_dump()) for chunk in chunks],
    }


def blocked_record(exc: RateLimitError) -> dict[str, Any]:
    kind = f"{type(exc).__module__}.{type(exc).__name__}"
    return {"outcome": "blocked", "error": kind, "status": exc.status_code, "message": str(exc)}


def sync_call(route: str, n: int, args: argparse.Namespace, *, stream: bool) -> None:
    try:
        answer = litellm.completion(**request(route, n, args, stream=stream))
        result = stream_record(list(answer)) if stream else {"usage": usage_of(answer)}
        emit(path="sync", route=route, stream=stream, outcome="ok", **result)
    except RateLimitError as exc:
        emit(path="sync", route=route, stream=stream, **blocked_record(exc))


async def async_call(route: str, n: int, args: argparse.Namespace, *, stream: bool) -> None:
    try:
        answer = await litellm.acompletion(**request(route, n, args, stream=stream))
        result = stream_record([chunk async for chunk in answer]) if stream else {"usage": usage_of(answer)}
        emit(path="async", route=route, stream=stream, outcome="ok", **result)
    except RateLimitError as exc:
        emit(path="async", route=route, stream=stream, **blocked_record(exc))
    except Exception as exc:  # the aiohttp_openai provider maps any 429 to an InternalServerError
        if "quotawrap blocked this request" not in str(exc):
            raise
        emit(path="async", route=route, stream=stream, **blocked_record(exc))  # type: ignore[arg-type]


async def until_blocked(route: str, worker: int, args: argparse.Namespace) -> None:
    for n in range(args.max_calls):
        try:
            answer = await litellm.acompletion(**request(route, n, args, stream=False))
            emit(path="async", route=route, worker=worker, outcome="ok", usage=usage_of(answer))
        except RateLimitError as exc:
            emit(path="async", route=route, worker=worker, **blocked_record(exc))
            return


async def at_once(calls: list[tuple[str, bool]], args: argparse.Namespace) -> None:
    await asyncio.gather(*(async_call(route, n, args, stream=stream) for n, (route, stream) in enumerate(calls)))


def run_mix(args: argparse.Namespace) -> None:
    for route in ("openai", "volcengine"):
        sync_call(route, 0, args, stream=False)
        sync_call(route, 1, args, stream=True)
    asyncio.run(at_once([(route, n % 2 == 1) for route in ("openai", "volcengine") for n in range(args.calls)], args))


def run_swarm(args: argparse.Namespace) -> None:
    async def workers() -> None:
        routes = ("openai", "volcengine")
        await asyncio.gather(*(until_blocked(routes[w % 2], w, args) for w in range(args.calls)))

    asyncio.run(workers())


def run_stream(args: argparse.Namespace) -> None:
    sync_call("openai", 0, args, stream=True)
    asyncio.run(at_once([("openai", True)], args))


def run_aiohttp(args: argparse.Namespace) -> None:
    asyncio.run(at_once([("aiohttp_openai", False)], args))


MODES = {"mix": run_mix, "swarm": run_swarm, "stream": run_stream, "aiohttp": run_aiohttp}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=sorted(MODES), default="mix")
    parser.add_argument("--calls", type=int, default=4)
    parser.add_argument("--max-calls", type=int, default=10, help="swarm: calls per worker at most")
    parser.add_argument("--max-tokens", type=int, default=200)
    args = parser.parse_args()
    MODES[args.mode](args)
    emit(carriers=sorted(_carriers))
    emit(egress=_egress)


if __name__ == "__main__":
    main()
