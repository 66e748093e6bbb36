"""A real ``quotawrap serve`` process for the gateway tests (not a test module)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any

MODEL = "deepseek-v4-flash"
_LISTENING = re.compile(r"listening on (http://\S+)")


class GatewayProcess:
    """``python -m quotawrap serve --port 0 ARGS``; ``url`` once it listens."""

    def __init__(
        self, args: Sequence[str], *, wrapped_by: Sequence[str] | None = None, env: dict[str, str] | None = None
    ) -> None:
        full_env = {**os.environ, **(env or {})}
        full_env.pop("QUOTAWRAP_RUN_ID", None)
        serve = [sys.executable, "-m", "quotawrap", "serve", "--port", "0", *args]
        if wrapped_by is not None:  # run by an outer `quotawrap [wrapped_by] --`, whose hook it then has
            serve = [sys.executable, "-m", "quotawrap", *wrapped_by, "--", *serve]
        self.process = subprocess.Popen(
            serve,
            env=full_env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.start_line = ""
        self.url = self._wait_for_url(timeout=30)

    def _wait_for_url(self, timeout: float) -> str:
        assert self.process.stdout is not None
        selector = selectors.DefaultSelector()
        selector.register(self.process.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not selector.select(timeout=0.5):
                continue
            line = self.process.stdout.readline()
            if not line:
                break
            found = _LISTENING.search(line)
            if found:
                self.start_line = line
                return found.group(1)
        self.process.kill()
        _, err = self.process.communicate()
        raise AssertionError(f"the gateway did not start:\n{err}")

    def terminate(self, timeout: float = 60) -> tuple[int, str]:
        """SIGTERM, then its exit code and stderr."""
        self.process.send_signal(signal.SIGTERM)
        _, err = self.process.communicate(timeout=timeout)
        return self.process.returncode, err

    def stop(self) -> None:
        """SIGTERM first: a wrapping quotawrap forwards it, so no gateway outlives the test."""
        if self.process.poll() is not None:
            return
        try:
            self.terminate(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.communicate()


@contextlib.contextmanager
def gateway(args: Sequence[str], **kwargs: Any) -> Iterator[GatewayProcess]:
    proc = GatewayProcess(args, **kwargs)
    try:
        yield proc
    finally:
        proc.stop()


def chat_body(*, stream: bool = False, max_tokens: int = 300, content: str = "hello") -> bytes:
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
    }
    if stream:
        body["stream"] = True
    return json.dumps(body).encode()
