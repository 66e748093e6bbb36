"""Ways around the hook: a raw socket to the guarded endpoint, and grandchildren without the hook.

Modes (argv[1]):
  raw-socket         POST by hand on a raw socket to $SIM_URL's host:port; prints "REFUSED <message>"
                     or "STATUS <code>".
  raw-asyncio        the same connection through asyncio.open_connection (loop.create_connection).
  route ROUTE        the raw-socket POST over a connection made another way: c-socket (_socket.socket()
                     .connect), c-method (_socket.socket.connect(s, addr)), fastopen (sendto with
                     MSG_FASTOPEN), mapped-v6 (AF_INET6 to ::ffff:<ipv4>), dup (a dup()ed socket connected
                     through the C method), bytes-host (b"<ip>"), short-v4 ("127.1"), name ("localhost"),
                     sendmsg (sendmsg with MSG_FASTOPEN); prints "REFUSED <message>" or "STATUS <code>".
  bare-env SECONDS   start a Python grandchild with env={} that sleeps SECONDS then prints "FINISHED";
                     prints "GRANDCHILD <pid> <returncode>".
  no-pythonpath      start a Python grandchild without PYTHONPATH that makes one urllib call to the
                     simulator; prints its output.
  shebang INTERPRETER  run a script whose shebang is "#!INTERPRETER -I"; it makes one urllib call to
                     the simulator and sleeps a second; prints "SCRIPT <pid>" and the script's "TOTAL <n>".
  other-python SECONDS  start $OTHER_PYTHON (an interpreter without quotawrap) without PYTHONPATH,
                     sleeping SECONDS then printing "FINISHED"; prints "GRANDCHILD <pid> <returncode>".
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from typing import Any
from urllib.parse import urlsplit

SIM_URL = os.environ["SIM_URL"].rstrip("/")


def _request() -> bytes:
    parts = urlsplit(SIM_URL)
    body = json.dumps(
        {"model": "deepseek-v4-flash", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 50}
    ).encode()
    head = (
        f"POST {parts.path}/chat/completions HTTP/1.1\r\nHost: {parts.netloc}\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer sk-test\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + body


def raw_socket() -> None:
    parts = urlsplit(SIM_URL)
    try:
        sock = socket.create_connection((parts.hostname, parts.port))
    except ConnectionRefusedError as exc:
        print("REFUSED", exc.strerror, flush=True)
        return
    sock.sendall(_request())
    _answer(sock)


def route(name: str) -> None:
    """One way around socket.socket.connect; the request goes out unless the guard refuses the connection."""
    import _socket

    parts = urlsplit(SIM_URL)
    address = (parts.hostname or "", parts.port or 80)
    request = _request()
    sock: Any
    try:
        if name == "c-socket":
            sock = _socket.socket()
            sock.connect(address)
        elif name == "c-method":
            sock = socket.socket()
            _socket.socket.connect(sock, address)
        elif name == "fastopen":
            sock = socket.socket()
            sent = sock.sendto(request, socket.MSG_FASTOPEN, address)
            request = request[sent:]
        elif name == "sendmsg":
            sock = socket.socket()
            sent = sock.sendmsg([request], [], socket.MSG_FASTOPEN, address)
            request = request[sent:]
        elif name == "mapped-v6":
            sock = socket.socket(socket.AF_INET6)
            sock.connect(("::ffff:" + address[0], address[1]))
        elif name == "dup":
            sock = socket.socket().dup()
            _socket.socket.connect(sock, address)
        elif name == "bytes-host":
            sock = socket.socket()
            sock.connect((address[0].encode(), address[1]))
        elif name == "name":
            sock = socket.socket()
            sock.connect(("localhost", address[1]))
        elif name == "short-v4":
            sock = socket.socket()
            sock.connect((address[0].replace(".0.0.", "."), address[1]))
        else:
            raise SystemExit(f"unknown route {name}")
    except ConnectionRefusedError as exc:
        print("REFUSED", exc.strerror, flush=True)
        return
    sock.sendall(request)
    _answer(sock)


def _answer(sock: Any) -> None:
    answer = b""
    while chunk := sock.recv(65536):
        answer += chunk
    sock.close()
    print("STATUS", answer.split(b" ", 2)[1].decode(), flush=True)


def raw_asyncio() -> None:
    import asyncio

    parts = urlsplit(SIM_URL)

    async def main() -> None:
        try:
            _reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
        except ConnectionRefusedError as exc:
            print("REFUSED", exc.strerror, flush=True)
            return
        writer.close()
        print("CONNECTED", flush=True)

    asyncio.run(main())


def bare_env(seconds: str) -> None:
    code = f"import time; time.sleep({float(seconds)}); print('FINISHED', flush=True)"
    proc = subprocess.Popen([sys.executable, "-c", code], env={})
    proc.wait()
    print("GRANDCHILD", proc.pid, proc.returncode, flush=True)


def other_python(seconds: str) -> None:
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    code = f"import time; time.sleep({float(seconds)}); print('FINISHED', flush=True)"
    proc = subprocess.Popen([os.environ["OTHER_PYTHON"], "-c", code], env=env)
    proc.wait()
    print("GRANDCHILD", proc.pid, proc.returncode, flush=True)


def shebang(interpreter: str) -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        script = os.path.join(tmp, "isolated.py")
        with open(script, "w", encoding="utf-8") as handle:
            handle.write(f"#!{interpreter} -I\n" + _URLLIB_CALL + "import time; time.sleep(1)\n")
        os.chmod(script, 0o700)
        proc = subprocess.Popen([script])
        print("SCRIPT", proc.pid, flush=True)
        proc.wait()


_URLLIB_CALL = f"""
import json, urllib.request
body = json.dumps({{"model": "deepseek-v4-flash", "messages": [{{"role": "user", "content": "hi"}}], "max_tokens": 50}})
request = urllib.request.Request({SIM_URL!r} + "/chat/completions", data=body.encode(),
    headers={{"Content-Type": "application/json", "Authorization": "Bearer sk-test"}})
print("TOTAL", json.load(urllib.request.urlopen(request))["usage"]["total_tokens"], flush=True)
"""


def no_pythonpath() -> None:
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    subprocess.run([sys.executable, "-c", _URLLIB_CALL], env=env, check=True)


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "raw-socket":
        raw_socket()
    elif mode == "raw-asyncio":
        raw_asyncio()
    elif mode == "route":
        route(sys.argv[2])
    elif mode == "bare-env":
        bare_env(sys.argv[2])
    elif mode == "no-pythonpath":
        no_pythonpath()
    elif mode == "shebang":
        shebang(sys.argv[2])
    elif mode == "other-python":
        other_python(sys.argv[2])
