"""The simulator's HTTP server: stdlib `ThreadingHTTPServer`, HTTP/1.1 keep-alive, chunked SSE streams.

Billing rule (what `billed_total()` counts): a generation is billed its full planned usage once,
at the moment the simulator commits to a 2xx answer, just before the response headers go out.
A real provider keeps generating whether or not the client reads, so a stream the client
abandons, a `cut` stream, a `hang` and a `no_usage` answer are all billed in full; error answers
(validation, auth, `error_*` faults, `error_rate`) are never billed.
"""

from __future__ import annotations

import contextlib
import json
import random
import signal
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import FrameType, TracebackType
from typing import Any, TextIO
from urllib.parse import parse_qs, urlsplit

from ._api import API_PREFIX, ENDPOINTS, ArkError, Generation, fault_error, status_type
from ._billing import BillBook, BillingRequestError, BillRecord, list_endpoints, list_resource_packages, report_packages
from ._config import PackageSpec, SimConfig, SimConfigError, apply_headers, apply_patch
from ._media import MEDIA_ENDPOINTS, TASKS_PATH, TaskBook
from ._payloads import ark_error

__all__ = ["ArkSimulator", "run_forever", "serve"]

Clock = Callable[[], float]
_JSON = "application/json; charset=utf-8"
_BILLING_VERSION = "2022-01-01"
_ARK_VERSION = "2024-01-01"  # the ark management API's (ListEndpoints)


class ArkSimulator:
    """A local Ark API: real HTTP on 127.0.0.1, deterministic usage, faults on demand, an honest bill.

    Use as a context manager, or `start()` / `stop()`. `clock` (default `time.time`) timestamps
    bills and drives the billing view's lag and package expiry; tests may replace it.
    """

    def __init__(
        self,
        config: SimConfig | None = None,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        clock: Clock = time.time,
        verbose: bool = False,
    ) -> None:
        self.clock: Clock = clock
        self.verbose = verbose
        self._host = host
        self._requested_port = port
        self._config = config or SimConfig()
        self._config_lock = threading.Lock()
        self._rng = random.Random(self._config.seed)
        self._rng_lock = threading.Lock()
        self._book = BillBook()
        self._tasks = TaskBook()
        self._stopping = threading.Event()
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> ArkSimulator:
        """Bind and serve in a background thread; a second call is a no-op."""
        if self._server is not None:
            return self
        self._stopping.clear()
        server = _Server((self._host, self._requested_port), self)
        self._thread = threading.Thread(
            target=server.serve_forever, kwargs={"poll_interval": 0.05}, name="ark-simulator", daemon=True
        )
        self._server = server
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving, end hanging and idle keep-alive connections, release the port."""
        server, thread = self._server, self._thread
        if server is None:
            return
        self._stopping.set()  # wakes `hang`, latency and chunk-delay waits
        server.shutdown()
        server.close_open_connections()
        server.server_close()
        if thread is not None:
            thread.join()
        self._server = self._thread = None

    def __enter__(self) -> ArkSimulator:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    @property
    def port(self) -> int:
        if self._server is None:
            raise RuntimeError("the simulator is not running; call start() first")
        return int(self._server.server_address[1])

    @property
    def base_url(self) -> str:
        """`http://host:port`, without the `/api/v3` prefix (control and billing paths live here)."""
        host = "127.0.0.1" if self._host in ("", "0.0.0.0") else self._host
        return f"http://{host}:{self.port}"

    @property
    def url(self) -> str:
        """The Ark base URL to hand to an SDK: `http://host:port/api/v3`."""
        return self.base_url + API_PREFIX

    # -- configuration -----------------------------------------------------------------------
    @property
    def config(self) -> SimConfig:
        return self._config

    def set_config(self, config: SimConfig) -> None:
        with self._config_lock:
            if config.seed != self._config.seed:
                with self._rng_lock:
                    self._rng = random.Random(config.seed)
            self._config = config

    def configure(self, **changes: Any) -> SimConfig:
        """Patch config fields by name (values as in `POST /_sim/config`); returns the new config."""
        return self.patch_config(changes)

    def patch_config(self, patch: Mapping[str, Any]) -> SimConfig:
        with self._config_lock:
            config = apply_patch(self._config, patch)
        self.set_config(config)
        return config

    def set_packages(self, packages: Iterable[PackageSpec | Mapping[str, Any]]) -> None:
        """Replace the prepaid packages the billing API reports."""
        specs = tuple(PackageSpec.from_json(p) for p in packages)
        self.patch_config({"packages": specs})

    def set_clock(self, clock: Clock) -> None:
        self.clock = clock

    # -- the bill ----------------------------------------------------------------------------
    def billed_total(self) -> int:
        """Every token billed so far (sum of usage.total_tokens of billed generations)."""
        return int(self.stats()["billed_total"])

    def billed_by_model(self) -> dict[str, int]:
        return dict(self.stats()["billed_by_model"])

    def calls(self) -> int:
        """Billed generations so far (errors are not calls)."""
        return int(self.stats()["calls"])

    def bills(self) -> list[BillRecord]:
        self._finish_tasks()
        return self._book.records()

    def requests_by_path(self) -> dict[str, int]:
        """Every request seen per path, errors included (control paths excluded)."""
        return self._book.requests_by_path()

    def stats(self) -> dict[str, Any]:
        """What `GET /_sim/stats` returns."""
        self._finish_tasks()
        return self._book.stats()

    def reset(self) -> None:
        """Forget every bill, request count and task (packages refill); the config stays."""
        self._book.reset()
        self._tasks.reset()

    def _finish_tasks(self) -> None:
        """Bill the video tasks that have finished by now (a real provider bills them unwatched)."""
        for task in self._tasks.due(self.clock()):
            self._book.bill(BillRecord(task.ready_at, task.model, TASKS_PATH, 0, task.tokens))

    def package_report(self, now: float | None = None) -> list[dict[str, str]]:
        """The ListResourcePackages items as the billing API would report them at `now`."""
        config = self._config
        when = self.clock() if now is None else now
        return report_packages(config.packages, self.bills(), when, config.balance_lag_s)

    # -- used by the handler -----------------------------------------------------------------
    def _draw_error(self, config: SimConfig) -> bool:
        if config.error_rate <= 0:
            return False
        with self._rng_lock:
            return self._rng.random() < config.error_rate

    def _bill(self, generation: Generation, path: str) -> None:
        plan = generation.plan
        record = BillRecord(self.clock(), generation.model, path, plan.prompt_tokens, plan.completion_tokens)
        self._book.bill(record)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 1024

    def __init__(self, address: tuple[str, int], sim: ArkSimulator) -> None:
        self.sim = sim
        self._open: set[socket.socket] = set()
        self._open_lock = threading.Lock()
        super().__init__(address, _Handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._open_lock:
            self._open.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request: Any) -> None:
        with self._open_lock:
            self._open.discard(request)
        super().shutdown_request(request)

    def close_open_connections(self) -> None:
        # Idle keep-alive handlers block in readline(); a shutdown makes them see EOF and exit.
        with self._open_lock:
            sockets = list(self._open)
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def handle_error(self, request: Any, client_address: Any) -> None:
        if isinstance(sys.exc_info()[1], (ConnectionError, TimeoutError)):
            return  # a client that went away is not a server error
        super().handle_error(request, client_address)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # Headers and body go out in separate writes; with Nagle on, a small body waits for the
    # client's delayed ACK of the headers on every keep-alive call.
    disable_nagle_algorithm = True
    server_version = "ArkSimulator/0.1"
    sys_version = ""
    timeout = 120.0  # idle keep-alive connections are dropped after this long
    server: _Server

    def do_GET(self) -> None:
        self._handle()

    def do_POST(self) -> None:
        self._handle()

    def do_PUT(self) -> None:
        self._handle()

    def do_DELETE(self) -> None:
        self._handle()

    def do_PATCH(self) -> None:
        self._handle()

    def log_message(self, format: str, *args: Any) -> None:
        if self.server.sim.verbose:
            super().log_message(format, *args)

    # -- plumbing ----------------------------------------------------------------------------
    def _handle(self) -> None:
        try:
            self._route()
        except OSError:  # BrokenPipe, ConnectionReset, timeouts: the client is gone
            self.close_connection = True

    def _route(self) -> None:
        split = urlsplit(self.path)
        path = split.path
        raw = self._read_body()  # always drained, so the next keep-alive request parses
        if path.startswith("/_sim/"):
            self._control(path, raw)
            return
        query = {k: v[0] for k, v in parse_qs(split.query).items()}
        if (path == "/" and "Action" in query) or path.startswith("/billing/"):
            self._billing(path, query, raw)
            return
        self._api(path, raw)

    def _read_body(self) -> bytes:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            return self._read_chunked()
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length > 0 else b""

    def _read_chunked(self) -> bytes:
        parts: list[bytes] = []
        while True:
            size = int(self.rfile.readline(65537).split(b";")[0].strip() or b"0", 16)
            if size == 0:
                while self.rfile.readline(65537) not in (b"\r\n", b"\n", b""):
                    pass  # trailers
                return b"".join(parts)
            parts.append(self.rfile.read(size))
            self.rfile.readline()

    def _send_json(self, status: int, obj: Any, request_id: str | None = None) -> None:
        data = json.dumps(obj, ensure_ascii=False).encode()
        self.send_response(status)
        self.send_header("Content-Type", _JSON)
        self.send_header("Content-Length", str(len(data)))
        if request_id:
            self.send_header("X-Request-Id", request_id)
        self.end_headers()
        self.wfile.write(data)

    def _send_ark_error(self, error: ArkError, request_id: str) -> None:
        message = f"{error.message} Request id: {request_id}"
        body = ark_error(error.code, message, error.param, status_type(error.status))
        self._send_json(error.status, body, request_id)

    def _write_chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))

    def _abort(self) -> None:
        """Drop the connection mid-answer: the client sees EOF before the body is complete."""
        self.close_connection = True
        with contextlib.suppress(OSError):
            self.connection.shutdown(socket.SHUT_RDWR)

    # -- Ark inference -----------------------------------------------------------------------
    def _api(self, path: str, raw: bytes) -> None:
        sim = self.server.sim
        # Ark's request ids: "02", the millisecond clock (13 digits), 38 hex digits
        ident = f"{int(time.time() * 1000)}{uuid.uuid4().hex}{uuid.uuid4().hex[:6]}"
        request_id = f"02{ident}"
        sim._book.count_request(path)
        sim._finish_tasks()
        if sim.config.redirect_to and self.command == "POST":
            self._redirect(sim.config.redirect_to, path)
            return
        if path == TASKS_PATH or path.startswith(TASKS_PATH + "/"):
            self._task_api(path, raw, ident, request_id)
            return
        try:
            generation, config, fault = self._prepare(path, raw, ident)
        except ArkError as error:
            self._send_ark_error(error, request_id)
            return
        sim._bill(generation, path)  # the provider generates from here on, whoever listens
        self._answer(generation, config, fault, request_id)

    def _task_api(self, path: str, raw: bytes, ident: str, request_id: str) -> None:
        """Video tasks: POST creates (billed when it finishes), GET reads one or lists, DELETE cancels."""
        sim = self.server.sim
        task_id = path[len(TASKS_PATH) + 1 :]
        try:
            config = self._checked_config()
            if self.command == "POST" and not task_id:
                error = fault_error(config.fault, config.error_code) if config.fault else None
                if error is not None:
                    raise error
                answer = sim._tasks.create(_json_object(raw), config, ident, sim.clock())
            elif self.command == "GET":
                answer = sim._tasks.view(task_id, sim.clock()) if task_id else sim._tasks.listing(sim.clock())
            elif self.command == "DELETE" and task_id:
                answer = sim._tasks.cancel(task_id, sim.clock())
            else:
                raise ArkError(405, "MethodNotAllowed", f"{self.command} is not allowed on {path}.")
        except ArkError as error:
            self._send_ark_error(error, request_id)
            return
        self._send_json(200, answer, request_id)

    def _checked_config(self) -> SimConfig:
        config = self.server.sim.config
        if config.require_auth and not _has_bearer(self.headers.get("Authorization"), config.api_keys):
            raise ArkError(401, "AuthenticationError", "The API key or AK/SK in the request is missing or invalid.")
        try:
            return apply_headers(config, self.headers.items())
        except SimConfigError as exc:
            raise ArkError(400, "InvalidParameter", exc.message, exc.param) from None

    def _redirect(self, base: str, path: str) -> None:
        """A 307 to the same path under another base URL: the client re-sends the request there."""
        self.send_response(307)
        self.send_header("Location", base.rstrip("/") + path[len(API_PREFIX) :])
        self.send_header("Content-Length", "0")
        self.end_headers()

    def _prepare(self, path: str, raw: bytes, ident: str) -> tuple[Generation, SimConfig, str | None]:
        sim = self.server.sim
        endpoint = ENDPOINTS.get(path) or MEDIA_ENDPOINTS.get(path)
        if endpoint is None:
            raise ArkError(404, "NotFound", f"The requested resource {path} was not found.")
        if self.command != "POST":
            raise ArkError(405, "MethodNotAllowed", f"{self.command} is not allowed on {path}.")
        config = self._checked_config()
        body = _served(_json_object(raw), config)
        generation = endpoint(body, config, ident, int(sim.clock()))
        if config.latency_s and sim._stopping.wait(config.latency_s):
            raise ArkError(500, "InternalServiceError", "The simulator is shutting down.")
        fault = config.fault
        if fault is None and sim._draw_error(config):
            fault = "error_500"
        error = fault_error(fault, config.error_code) if fault else None
        if error is not None:
            raise error
        return generation, config, fault

    def _answer(self, generation: Generation, config: SimConfig, fault: str | None, request_id: str) -> None:
        with_usage = fault != "no_usage"
        stopping = self.server.sim._stopping
        if not generation.stream:
            body = generation.body(with_usage)
            if fault == "implausible_usage" and isinstance(body.get("usage"), dict):
                body["usage"] = {**body["usage"], "total_tokens": 2**63}  # billed as generated, reported absurd
            data = json.dumps(body, ensure_ascii=False).encode()
            self.send_response(200)
            self.send_header("Content-Type", _JSON)
            self.send_header("Content-Length", str(len(data)))
            self.send_header("X-Request-Id", request_id)
            self.end_headers()
            if fault == "hang":
                stopping.wait(config.hang_s)
            if fault in ("cut", "hang"):
                self._abort()
                return
            self.wfile.write(data)
            return
        frames = generation.frames(with_usage)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream; charset=utf-8")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.send_header("X-Request-Id", request_id)
        self.end_headers()
        if fault == "hang":
            stopping.wait(config.hang_s)
            self._abort()
            return
        if fault == "cut":
            frames = frames[: len(frames) // 2]
        for index, frame in enumerate(frames):
            if index and config.chunk_delay_s and stopping.wait(config.chunk_delay_s):
                self._abort()
                return
            self._write_chunk(frame)
        if fault == "cut":
            self._abort()
            return
        self.wfile.write(b"0\r\n\r\n")

    # -- control API -------------------------------------------------------------------------
    def _control(self, path: str, raw: bytes) -> None:
        sim = self.server.sim
        try:
            self._send_json(200, self._control_result(sim, path, raw))
        except SimConfigError as exc:
            self._send_json(400, ark_error("InvalidParameter", exc.message, exc.param, "BadRequest"))
        except ArkError as error:
            self._send_json(error.status, ark_error(error.code, error.message, error.param, status_type(error.status)))

    def _control_result(self, sim: ArkSimulator, path: str, raw: bytes) -> Any:
        post = self.command == "POST"
        if path == "/_sim/health":
            return {"ok": True}
        if path == "/_sim/stats" and not post:
            return sim.stats()
        if path == "/_sim/reset" and post:
            sim.reset()
            return {"ok": True}
        if path == "/_sim/config":
            if post:
                sim.patch_config(_json_object(raw))
            return sim.config.to_json()
        if path == "/_sim/packages":
            if post:
                body = _json_value(raw) if raw.strip() else []
                packages = body.get("packages") if isinstance(body, dict) else body
                if not isinstance(packages, list):
                    raise SimConfigError("packages", "expected a list of packages or {'packages': [...]}")
                sim.set_packages(packages)
            return {"packages": [p.to_json() for p in sim.config.packages], "report": sim.package_report()}
        raise ArkError(404, "NotFound", f"No control endpoint {self.command} {path}.")

    # -- billing (Volcengine OpenAPI) --------------------------------------------------------
    def _billing(self, path: str, query: dict[str, str], raw: bytes) -> None:
        sim = self.server.sim
        action = query.get("Action") or path.rstrip("/").rsplit("/", 1)[-1]
        version = query.get("Version", _BILLING_VERSION)
        sim._book.count_request(f"/?Action={action}")
        metadata = {
            "RequestId": f"{int(time.time() * 1000)}{uuid.uuid4().hex[:16].upper()}",
            "Action": action,
            "Version": version,
            "Service": "billing",
            "Region": "cn-beijing",
        }

        def fail(status: int, code: str, message: str) -> None:
            self._send_json(status, {"ResponseMetadata": {**metadata, "Error": {"Code": code, "Message": message}}})

        if action == "ListEndpoints" and version == _ARK_VERSION:
            if not self.headers.get("Authorization"):
                fail(401, "MissingAuthenticationToken", "The request must contain an Authorization header.")
                return
            try:
                result = list_endpoints(sim.config.endpoints, _json_object(raw) if raw.strip() else dict(query))
            except (BillingRequestError, ArkError) as exc:
                fail(400, "InvalidParameter", exc.message)
                return
            self._send_json(200, {"ResponseMetadata": {**metadata, "Service": "ark"}, "Result": result})
            return
        if action != "ListResourcePackages" or version != _BILLING_VERSION:
            fail(404, "InvalidActionOrVersion", f"Could not find operation {action} for version {version}")
            return
        if not self.headers.get("Authorization"):
            fail(401, "MissingAuthenticationToken", "The request must contain an Authorization header.")
            return
        try:
            request = _json_object(raw) if raw.strip() else dict(query)
            result = list_resource_packages(sim.package_report(), request)
        except BillingRequestError as exc:
            fail(400, exc.code, exc.message)
            return
        except ArkError as error:
            fail(400, "InvalidParameter", error.message)
            return
        self._send_json(200, {"ResponseMetadata": metadata, "Result": result})


def _served(body: dict[str, Any], config: SimConfig) -> dict[str, Any]:
    """A call through an endpoint id is served by the endpoint's foundation model: Ark answers with that
    model's id in `model` ("本次请求实际使用的模型名称和版本", the Chat API doc) and bills it as that model."""
    model = body.get("model")
    served = config.endpoint_model(model) if isinstance(model, str) else None
    return body if served is None else {**body, "model": served}


def _has_bearer(header: str | None, accepted: tuple[str, ...]) -> bool:
    """A bearer key, one of ``accepted`` unless that is empty."""
    if not header:
        return False
    scheme, _, key = header.partition(" ")
    key = key.strip()
    return scheme.lower() == "bearer" and bool(key) and (not accepted or key in accepted)


def _json_value(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise ArkError(400, "InvalidParameter", "The request body is not valid JSON.") from None


def _json_object(raw: bytes) -> dict[str, Any]:
    body = _json_value(raw)
    if not isinstance(body, dict):
        raise ArkError(400, "InvalidParameter", "The request body must be a JSON object.")
    return body


def serve(host: str = "127.0.0.1", port: int = 0, config: SimConfig | None = None) -> ArkSimulator:
    """Start a simulator on `host:port` (0 picks a free port) and return it, running."""
    return ArkSimulator(config, host=host, port=port).start()


def run_forever(sim: ArkSimulator, *, stop: threading.Event | None = None, out: TextIO | None = None) -> None:
    """Serve until SIGINT/SIGTERM (or `stop` is set), after printing the URL line; then stop `sim`."""
    done = stop or threading.Event()
    previous: dict[signal.Signals, Any] = {}
    if threading.current_thread() is threading.main_thread():

        def on_signal(signum: int, frame: FrameType | None) -> None:
            done.set()

        for signum in (signal.SIGINT, signal.SIGTERM):
            previous[signum] = signal.signal(signum, on_signal)
    try:
        sim.start()
        print(f"Ark simulator listening on {sim.url}", file=out or sys.stdout, flush=True)
        while not done.wait(0.2):  # short waits keep the main thread responsive to signals
            pass
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        sim.stop()
