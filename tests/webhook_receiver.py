"""A real webhook receiver for the alert tests: an HTTP server on 127.0.0.1 that keeps each JSON body posted."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class Receiver:
    """What a webhook received: ``bodies`` (answered 200) and ``refused`` (the first ``fail_first`` posts,
    answered 500)."""

    def __init__(self, fail_first: int = 0) -> None:
        self.fail_first = fail_first
        self.bodies: list[dict[str, Any]] = []
        self.refused = 0
        self.lock = threading.Lock()
        self.url = ""

    def take(self, body: bytes) -> int:
        with self.lock:
            if self.refused < self.fail_first:
                self.refused += 1
                return 500
            self.bodies.append(json.loads(body))
            return 200

    def thresholds(self) -> list[tuple[str, str, float]]:
        """(limit kind, name, threshold percent) of every threshold some alert announced, as posted."""
        with self.lock:
            return [
                (body["quotawrap"]["limit"], body["quotawrap"]["name"], percent)
                for body in self.bodies
                for percent in body["quotawrap"]["thresholds_percent"]
            ]


@contextmanager
def webhook(fail_first: int = 0) -> Iterator[Receiver]:
    receiver = Receiver(fail_first)

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("content-length", 0)))
            status = receiver.take(body)
            self.send_response(status)
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    receiver.url = f"http://127.0.0.1:{server.server_address[1]}/services/T0/B0/secret-part"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield receiver
    finally:
        server.shutdown()
        server.server_close()
