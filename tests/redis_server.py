"""A private ``redis-server`` for the tests (not a test module).

``redis-server`` from PATH is started on a free loopback port in a temporary directory, without
persistence unless asked, and stopped afterwards. Without the binary the tests use ``REDIS_URL``;
without either they fail (never skip) with a message saying what to install.

The test modules build their fixtures from these helpers::

    from tests.redis_server import flushed, private_server, session_url
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

__all__ = [
    "NO_REDIS",
    "RedisCluster3",
    "RedisServer",
    "cluster_unavailable_reason",
    "flushed",
    "free_port",
    "private_server",
    "redis_binary",
    "session_url",
]

NO_REDIS = (
    "these tests need a real Redis: install redis-server (Debian: apt-get install redis-server)"
    " so the suite can start a private one, or set REDIS_URL=redis://HOST:PORT/DB to a disposable database"
)
_START_TIMEOUT_S = 10.0


def redis_binary() -> str | None:
    return shutil.which("redis-server")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def free_cluster_port() -> int:
    """A free port whose cluster bus port (+10000) is free too; Redis wants it <= 55535."""
    rng = random.Random()
    for _ in range(200):
        port = rng.randint(20_000, 55_000)
        try:
            for candidate in (port, port + 10_000):
                with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                    sock.bind(("127.0.0.1", candidate))
        except OSError:
            continue
        return port
    raise RuntimeError("no free port pair for a Redis Cluster node")


def _ping(port: int) -> bool:
    import redis

    client = redis.Redis(host="127.0.0.1", port=port, socket_connect_timeout=0.2, socket_timeout=0.5)
    try:
        return bool(client.ping())
    except redis.exceptions.RedisError:
        return False
    finally:
        client.close()


class RedisServer:
    """One redis-server process on 127.0.0.1; ``restart()`` keeps the port and the directory."""

    def __init__(
        self,
        binary: str,
        *,
        appendonly: bool = False,
        cluster: bool = False,
        directory: Path | None = None,
        port: int | None = None,
    ) -> None:
        self.binary = binary
        self.appendonly = appendonly
        self.cluster = cluster
        self.port = port or (free_cluster_port() if cluster else free_port())
        self._own_dir = directory is None
        self.directory = directory or Path(tempfile.mkdtemp(prefix="qw-redis-"))
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _argv(self) -> list[str]:
        argv = [
            self.binary,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--dir", str(self.directory),
            "--save", "",
            "--appendonly", "yes" if self.appendonly else "no",
            "--daemonize", "no",
            "--logfile", str(self.directory / "redis.log"),
        ]  # fmt: skip
        if self.cluster:
            argv += ["--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{self.port}.conf"]
        return argv

    def start(self) -> RedisServer:
        self.process = subprocess.Popen(self._argv(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + _START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                log = (self.directory / "redis.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"redis-server exited with {self.process.returncode}:\n{log}")
            if _ping(self.port):
                return self
            time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"redis-server did not answer PING on port {self.port}")

    def stop(self) -> None:
        """Graceful: SHUTDOWN lets an AOF server write its file first (NOSAVE: no RDB)."""
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        process.terminate()  # SIGTERM: redis-server flushes its AOF and exits
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    def restart(self) -> None:
        self.stop()
        self.start()

    def cleanup(self) -> None:
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.directory, ignore_errors=True)


def cluster_unavailable_reason() -> str | None:
    """Why a loopback Cluster cannot be had here, or None."""
    binary = redis_binary()
    if binary is None:
        return "no redis-server binary to start a Cluster from"
    version = subprocess.run([binary, "--version"], capture_output=True, text=True, check=False).stdout
    major = next((part[2:].split(".")[0] for part in version.split() if part.startswith("v=")), "0")
    if not major.isdigit() or int(major) < 7:
        return f"redis-server {version.strip()!r} lacks CLUSTER ADDSLOTSRANGE (needs 7.0)"
    return None


class RedisCluster3:
    """Three cluster-enabled masters on loopback, slots split three ways, no replicas."""

    def __init__(self, binary: str) -> None:
        self.directory = Path(tempfile.mkdtemp(prefix="qw-cluster-"))
        self.nodes = [RedisServer(binary, cluster=True, directory=self.directory) for _ in range(3)]

    @property
    def url(self) -> str:
        return self.nodes[0].url

    def start(self) -> RedisCluster3:
        import redis

        for node in self.nodes:
            node.start()
        clients = [redis.Redis(host="127.0.0.1", port=node.port) for node in self.nodes]
        try:
            bounds = [(0, 5460), (5461, 10922), (10923, 16383)]
            for client, (low, high) in zip(clients, bounds, strict=True):
                client.execute_command("CLUSTER", "ADDSLOTSRANGE", low, high)
            for node in self.nodes[1:]:
                clients[0].execute_command("CLUSTER", "MEET", "127.0.0.1", node.port)
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                states = [client.execute_command("CLUSTER", "INFO") for client in clients]
                texts = [s.decode() if isinstance(s, bytes) else str(s) for s in states]
                if all("cluster_state:ok" in t and "cluster_known_nodes:3" in t for t in texts):
                    return self
                time.sleep(0.1)
            raise RuntimeError("the loopback Redis Cluster did not reach cluster_state:ok")
        finally:
            for client in clients:
                client.close()

    def cleanup(self) -> None:
        for node in self.nodes:
            node.stop()
        shutil.rmtree(self.directory, ignore_errors=True)


@contextlib.contextmanager
def private_server(*, appendonly: bool = True) -> Iterator[RedisServer]:
    """A private server (AOF on by default, for restart tests). Fails the test without the binary."""
    binary = redis_binary()
    if binary is None:
        pytest.fail("redis-server is not installed: " + NO_REDIS)
    server = RedisServer(binary, appendonly=appendonly).start()
    try:
        yield server
    finally:
        server.cleanup()


@contextlib.contextmanager
def session_url() -> Iterator[str]:
    """A private server without persistence, else REDIS_URL; fails the test when there is neither."""
    binary = redis_binary()
    if binary is not None:
        server = RedisServer(binary).start()
        try:
            yield server.url
        finally:
            server.cleanup()
        return
    url = os.environ.get("REDIS_URL")
    if not url:
        pytest.fail(NO_REDIS)
    yield url


def flushed(url: str) -> str:
    """The same database, emptied."""
    import redis

    client = redis.Redis.from_url(url)
    try:
        client.flushdb()
    finally:
        client.close()
    return url
