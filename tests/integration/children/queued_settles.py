"""CALLS sequential calls with the openai SDK while this process's settler is held back, so every
settle is still queued when the calls are done. Then, by MODE:

* ``exit``: let the settler go at exit (an atexit hook registered after quotawrap's, so it runs
  first) and end normally: quotawrap's own exit flush must land every queued settle;
* ``wait``: print ``QUEUED <pid> <n>`` and sleep, for the test to SIGKILL it;
* ``relayed``: keep the wrapper's settle socket (the other modes test this process's own settler,
  which a child uses when the wrapper does not take a settle), print ``QUEUED`` and SIGKILL itself.
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import time

import openai

from quotawrap.intercept import get_guard

guard = get_guard()
assert guard is not None and guard.settler is not None, "a guarded child settles in the background"
relayed = sys.argv[1:] == ["relayed"]
if not relayed:
    guard.settler._relay = None  # test-only: as if the wrapper refused every settle
# Test-only: holding the settler's landing lock keeps every settle queued (the thread waits on it).
paused = guard.settler._lock
paused.acquire()
atexit.register(paused.release)

sdk = openai.OpenAI(base_url=os.environ["SIM_URL"], api_key="sk-test", max_retries=0)
calls = int(os.environ.get("CALLS", "5"))
for number in range(calls):
    sdk.chat.completions.create(
        model="deepseek-v4-flash", messages=[{"role": "user", "content": "hello"}], max_tokens=100
    )
    if number == 0:  # the wrapper binds its socket once the run's first call opened the ledger: wait for it
        deadline = time.monotonic() + 10
        while not os.path.exists(os.environ["QUOTAWRAP_SETTLE_SOCKET"]) and time.monotonic() < deadline:
            time.sleep(0.01)
drawn = guard.advances.drawn if guard.advances is not None else 0
print(f"QUEUED {os.getpid()} {guard.settler.pending} {drawn}", flush=True)
if sys.argv[1:] == ["wait"]:
    time.sleep(120)
elif relayed:
    os.kill(os.getpid(), signal.SIGKILL)
