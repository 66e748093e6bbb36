"""The live view through the real CLI: a pseudo-terminal (pexpect) and plain pipes, against the simulator.

The terminal transcript is replayed into a VT100 emulator (pyte), so the assertions are about
what a user would see, not about escape sequences.
"""

from __future__ import annotations

import io
import os
import re
import sys
from pathlib import Path

import pexpect
import pyte

from quotawrap.simulator import ArkSimulator
from tests.conftest import run_quotawrap

MODEL = "deepseek-v4-flash"
COLUMNS, ROWS = 100, 24
ANSI = re.compile(r"\x1b")

# Streams CALLS answers of REPLY_TOKENS each (thinking off, so the hold is prompt + max_tokens).
# With WAIT_FOR_STDIN it stops after the first chunk until a line arrives: the hold stays open
# for as long as the test needs to look at it, without any timing.
CHILD = """
import os, sys
import openai

sdk = openai.OpenAI(base_url=os.environ["SIM_URL"], api_key="sk-test", max_retries=0)
tokens = os.environ["REPLY_TOKENS"]
for n in range(int(os.environ["CALLS"])):
    try:
        stream = sdk.chat.completions.create(
            model="deepseek-v4-flash",
            messages=[{"role": "user", "content": "tell a long story"}],
            max_tokens=int(tokens),
            stream=True,
            extra_body={"thinking": {"type": "disabled"}},
            extra_headers={"x-sim-reply-tokens": tokens, "x-sim-tokens-per-chunk": "50"},
        )
        for index, _chunk in enumerate(stream):
            if index == 0 and os.environ.get("WAIT_FOR_STDIN"):
                print("STREAMING", flush=True)
                sys.stdin.readline()
        print(f"CALL {n} DONE", flush=True)
    except openai.RateLimitError:
        print(f"CALL {n} BLOCKED", flush=True)
"""


def _child(tmp_path: Path) -> list[str]:
    script = tmp_path / "streamer.py"
    script.write_text(CHILD, encoding="utf-8")
    return [sys.executable, str(script)]


def _env(sim: ArkSimulator, **extra: str) -> dict[str, str]:
    env = {**os.environ, "SIM_URL": sim.url, "TERM": "xterm", **extra}
    env.pop("QUOTAWRAP_RUN_ID", None)
    return env


def _spawn(args: list[str], env: dict[str, str]) -> tuple[pexpect.spawn, io.StringIO]:
    transcript = io.StringIO()
    terminal = pexpect.spawn(
        sys.executable,
        ["-m", "quotawrap", *args],
        env=env,
        encoding="utf-8",
        dimensions=(ROWS, COLUMNS),
        timeout=60,
    )
    terminal.logfile_read = transcript
    return terminal, transcript


def _screen(transcript: str) -> list[str]:
    """The rows a user sees at the end (the pty already turned newlines into CR LF)."""
    screen = pyte.Screen(COLUMNS, ROWS)
    pyte.Stream(screen).feed(transcript)
    return [line.rstrip() for line in screen.display]


class TestLiveLineOnATerminal:
    def test_in_flight_while_streaming_then_settled(self, sim: ArkSimulator, store: str, tmp_path: Path) -> None:
        """Mid-stream the model's line shows the open hold shaded; after it settles, the final lines once."""
        terminal, transcript = _spawn(
            ["--store", store, "--base-url", sim.url, "--cap-tokens", "10000", "--", *_child(tmp_path)],
            _env(sim, CALLS="1", REPLY_TOKENS="1000", WAIT_FOR_STDIN="1"),
        )
        try:
            terminal.expect("STREAMING")
            # the child holds its stream open until we answer: the hold is in flight now
            terminal.expect(rf"{MODEL} +0 / 10k ▒+░+ 0% of run cap \(\+1(\.\d+)?k in flight\)")
            live = _screen(transcript.getvalue())
            terminal.sendline("go")
            terminal.expect(pexpect.EOF)
        finally:
            terminal.close(force=True)
        assert terminal.exitstatus == 0, transcript.getvalue()

        # what the user saw mid-stream: the block pinned at the bottom, the child's line above it
        assert "STREAMING" in live
        assert re.fullmatch(r"run +0 / 10k ▒+░+ 0% \(\+1(\.\d+)?k in flight\)", live[-2])
        assert re.fullmatch(rf"{MODEL} +0 / 10k ▒+░+ 0% of run cap \(\+1(\.\d+)?k in flight\)", live[-1])

        final = [line for line in _screen(transcript.getvalue()) if line]
        run_lines = [line for line in final if line.startswith("run ")]
        model_lines = [line for line in final if line.startswith(f"{MODEL} ")]
        assert len(run_lines) == 1, final
        assert len(model_lines) == 1, final
        assert re.fullmatch(r"run +1(\.\d+)?k / 10k █+░+ 1\d%", run_lines[0])
        assert re.fullmatch(rf"{MODEL} +1(\.\d+)?k / 10k █+░+ 1\d% of run cap", model_lines[0])
        assert not any("in flight" in line for line in final)
        # nothing the child printed was drawn over, and the summary comes after the final lines
        assert final.index("STREAMING") < final.index("CALL 0 DONE") < final.index(run_lines[0])
        assert final.index(model_lines[0]) < next(
            index for index, line in enumerate(final) if line.startswith("quotawrap: session")
        )

    def test_quiet_draws_nothing(self, sim: ArkSimulator, store: str, tmp_path: Path) -> None:
        """--quiet on a terminal: no live block, no final lines, no summary."""
        terminal, transcript = _spawn(
            ["--store", store, "--base-url", sim.url, "--cap-tokens", "10000", "--quiet", "--", *_child(tmp_path)],
            _env(sim, CALLS="1", REPLY_TOKENS="1000", WAIT_FOR_STDIN="1"),
        )
        try:
            terminal.expect("STREAMING")
            terminal.sendline("go")
            terminal.expect(pexpect.EOF)
        finally:
            terminal.close(force=True)
        text = transcript.getvalue()
        assert "CALL 0 DONE" in text
        assert "▒" not in text and "█" not in text
        assert "quotawrap" not in text
        assert not ANSI.search(text)


class TestPlainLogLines:
    def test_threshold_warnings_without_escapes(self, sim: ArkSimulator, store: str, tmp_path: Path) -> None:
        """Piped stderr: no ANSI, no bars; a plain line as the run passes 50% and one at 80% of the cap (one line
        at 80% alone when one look at the ledger finds both passed)."""
        # ~1,010 tokens a call against 3,700: settled 27%, 55%, 82%, then the fourth call is refused
        result = run_quotawrap(
            ["--store", store, "--base-url", sim.url, "--cap-tokens", "3700"],
            _child(tmp_path),
            env=_env(sim, CALLS="4", REPLY_TOKENS="1000"),
        )
        assert result.returncode == 0, result.stderr
        assert "CALL 3 BLOCKED" in result.stdout
        assert not ANSI.search(result.stderr)
        assert "▒" not in result.stderr and "█" not in result.stderr
        warnings = [line for line in result.stderr.splitlines() if " of run cap " in line]
        numbers = r"\(\d(\.\d+)?k / 3\.7k(, \+\d(\.\d+)?k in flight)?\)"
        percents = [re.fullmatch(rf"quotawrap: run at (\d+)% of run cap {numbers}", line) for line in warnings]
        assert all(percents), result.stderr
        assert [match.group(1) for match in percents if match] in (["50", "80"], ["80"]), result.stderr

    def test_quiet_silences_warnings(self, sim: ArkSimulator, store: str, tmp_path: Path) -> None:
        """--quiet: the same run logs no threshold line."""
        result = run_quotawrap(
            ["--store", store, "--base-url", sim.url, "--cap-tokens", "3700", "--quiet"],
            _child(tmp_path),
            env=_env(sim, CALLS="4", REPLY_TOKENS="1000"),
        )
        assert result.returncode == 0, result.stderr
        assert "CALL 3 BLOCKED" in result.stdout
        assert " of run cap " not in result.stderr
