"""Tests for quotawrap.core.endpoints: which requests are guarded, and what they ask for."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from quotawrap.core.endpoints import (
    Route,
    Router,
    classify,
    clean_path,
    model_matches,
    parse_json_body,
    route,
    stream_requested,
    wants_usage,
    with_usage_requested,
)

ARK_HOSTS = (
    "ark.cn-beijing.volces.com",
    "ark.cn-shanghai.volces.com",
    "ark.cn-guangzhou.volces.com",
    "ark.ap-southeast-1.volces.com",
    "ark.volces.com",
    "ark.ap-southeast.bytepluses.com",
    "ark.eu-west.bytepluses.com",
)

BILLED = (
    ("/api/v3/chat/completions", "chat"),
    ("/api/v3/bots/chat/completions", "chat"),
    ("/api/v3/context/chat/completions", "chat"),
    ("/api/v3/batch/chat/completions", "chat"),
    ("/api/v3/completions", "completions"),
    ("/api/v3/responses", "responses"),
    ("/api/v3/embeddings", "embeddings"),
    ("/api/v3/embeddings/multimodal", "embeddings"),
    ("/api/coding/v3/chat/completions", "chat"),
    ("/api/v3/images/generations", "images"),
    ("/api/v3/contents/generations/tasks", "video"),
    ("/api/v3/context/create", "context"),
    ("/api/v3/classification", "classification"),
    ("/api/v3/batch/embeddings", "embeddings"),
)


class TestClassifyArkHosts:
    @pytest.mark.parametrize("host", ARK_HOSTS)
    def test_every_region_is_guarded(self, host: str) -> None:
        """Chat on any VolcEngine Ark region or BytePlus ModelArk host is guarded without --base-url."""
        assert classify("POST", f"https://{host}/api/v3/chat/completions") == "chat"

    def test_host_letter_case_and_port_do_not_matter(self) -> None:
        """The host is compared case-insensitively and an explicit port keeps it guarded."""
        assert classify("POST", "https://ARK.CN-BEIJING.VOLCES.COM:443/api/v3/chat/completions") == "chat"

    @pytest.mark.parametrize(
        "host",
        [
            "ark.cn-beijing.volces.com.evil.example",
            "notark.cn-beijing.volces.com",
            "ark.cn-beijing.volcengine.com",
            "api.openai.com",
            "open.volcengineapi.com",
            "ark.cn_beijing.volces.com",
        ],
    )
    def test_look_alike_hosts_are_not_guarded(self, host: str) -> None:
        """Only real Ark hosts match: no suffix tricks, no other providers."""
        assert classify("POST", f"https://{host}/api/v3/chat/completions") is None

    @pytest.mark.parametrize(("path", "kind"), BILLED)
    def test_billed_suffixes(self, path: str, kind: str) -> None:
        """Every token-billed path maps to the kind the estimator needs."""
        assert classify("POST", f"https://ark.cn-beijing.volces.com{path}") == kind

    def test_trailing_slash_and_query_are_ignored(self) -> None:
        """A trailing slash or a query string does not hide a billed call."""
        url = "https://ark.cn-beijing.volces.com/api/v3/chat/completions/?ak=1"
        assert classify("POST", url) == "chat"

    @pytest.mark.parametrize(
        "path",
        [
            "/api/v3/responses/resp_0217abc",
            "/api/v3/responses/resp_0217abc/input_items",
            "/api/v3/responses/resp_0217abc/cancel",
            "/api/v3/models",
            "/api/v3/chat/completions/extra",
        ],
    )
    def test_unbilled_paths_pass(self, path: str) -> None:
        """Paths that are no billed endpoint have no kind to estimate (route() refuses or passes them)."""
        assert classify("POST", f"https://ark.cn-beijing.volces.com{path}") is None

    @pytest.mark.parametrize("method", ["GET", "DELETE", "PUT", "HEAD", "OPTIONS"])
    def test_only_post_is_billed(self, method: str) -> None:
        """GET /responses/{id} and friends never spend tokens."""
        assert classify(method, "https://ark.cn-beijing.volces.com/api/v3/responses") is None

    def test_method_letter_case(self) -> None:
        """A lower-case method name is still a POST."""
        assert classify("post", "https://ark.cn-beijing.volces.com/api/v3/responses") == "responses"


class TestClassifyBaseUrls:
    BASE = "http://h:8000/api/v3"

    def test_unknown_host_needs_a_base_url(self) -> None:
        """An OpenAI-compatible server is guarded only when its base URL was given."""
        url = "http://h:8000/api/v3/chat/completions"
        assert classify("POST", url) is None
        assert classify("POST", url, [self.BASE]) == "chat"

    def test_prefix_boundary(self) -> None:
        """`/api/v3x` is not under `/api/v3`: the prefix ends at a path segment."""
        assert classify("POST", "http://h:8000/api/v3x/chat/completions", [self.BASE]) is None

    def test_trailing_slash_on_the_base(self) -> None:
        """A base URL written with a trailing slash guards the same calls."""
        assert classify("POST", "http://h:8000/api/v3/chat/completions", [self.BASE + "/"]) == "chat"

    def test_other_origin_is_not_guarded(self) -> None:
        """Another port, host or scheme is another server."""
        for url in (
            "http://h:8001/api/v3/chat/completions",
            "http://g:8000/api/v3/chat/completions",
            "https://h:8000/api/v3/chat/completions",
        ):
            assert classify("POST", url, [self.BASE]) is None, url

    def test_host_case_is_not_significant(self) -> None:
        """httpx lower-cases the host it sends to; a base URL typed in capitals must still match."""
        assert classify("POST", "http://localhost:8000/v1/chat/completions", ["http://LOCALHOST:8000/v1"]) == "chat"

    def test_default_port_spelt_or_not(self) -> None:
        """httpx drops `:443`, requests keeps it: both spellings of one origin match each other."""
        assert classify("POST", "https://api.example.com/v1/responses", ["https://api.example.com:443/v1"]) == (
            "responses"
        )
        assert classify("POST", "https://api.example.com:443/v1/responses", ["https://api.example.com/v1"]) == (
            "responses"
        )

    def test_base_url_without_a_path(self) -> None:
        """A bare origin guards every billed path on it."""
        assert classify("POST", "http://h:8000/v1/embeddings", ["http://h:8000"]) == "embeddings"

    def test_unbilled_path_under_a_base_url(self) -> None:
        """Being under a guarded base URL is not enough: the path must be billed."""
        assert classify("POST", "http://h:8000/api/v3/models", [self.BASE]) is None

    def test_any_of_several_base_urls(self) -> None:
        """--base-url is repeatable."""
        bases = ["http://a/v1", self.BASE]
        assert classify("POST", "http://h:8000/api/v3/completions", bases) == "completions"

    def test_malformed_port_is_not_guarded_and_does_not_raise(self) -> None:
        """A URL with a non-numeric port cannot match (and classify never raises on it)."""
        assert classify("POST", "http://h:port/api/v3/chat/completions", [self.BASE]) is None


class TestModelMatches:
    def test_no_patterns_means_every_model(self) -> None:
        """Without --model every model is guarded."""
        assert model_matches("anything", ())

    def test_exact(self) -> None:
        """An exact id matches."""
        assert model_matches("doubao-seed-1-6-250615", ["doubao-seed-1-6-250615"])

    def test_prefix(self) -> None:
        """A pattern without wildcards is a prefix."""
        assert model_matches("deepseek-v3-250324", ["deepseek"])
        assert not model_matches("doubao-seed-1-6", ["deepseek"])

    def test_glob(self) -> None:
        """A pattern with wildcards is a whole-name glob, case-sensitive."""
        assert model_matches("deepseek-r1-250528", ["deepseek-*"])
        assert model_matches("ep-20250101-abcde", ["ep-2025????-*"])
        assert not model_matches("my-deepseek-r1", ["deepseek-*"])
        assert not model_matches("DeepSeek-r1", ["deepseek-*"])

    def test_character_class(self) -> None:
        """`[...]` is a glob too, not a literal prefix."""
        assert model_matches("model-a", ["model-[ab]"])
        assert not model_matches("model-c", ["model-[ab]"])

    def test_none_match(self) -> None:
        """When no pattern matches, the model is not guarded."""
        assert not model_matches("glm-4", ["deepseek-*", "doubao"])

    def test_any_pattern_suffices(self) -> None:
        """Patterns are alternatives."""
        assert model_matches("doubao-pro", ["deepseek-*", "doubao"])


class TestParseJsonBody:
    @pytest.mark.parametrize("body", [None, b"", b"not json", b"[1, 2]", b'"text"', b"\xff\xfe"])
    def test_refuses_what_is_not_a_json_object(self, body: bytes | None) -> None:
        """Anything but a JSON object is a ValueError with a reason."""
        with pytest.raises(ValueError, match=r"\S"):
            parse_json_body(body)

    def test_reads_an_object(self) -> None:
        """A JSON object comes back as a dict."""
        assert parse_json_body(b'{"model": "m"}') == {"model": "m"}


class TestStreamAndUsageFlags:
    def test_stream_requested_only_for_true(self) -> None:
        """Only a JSON `true` asks for a stream."""
        assert stream_requested({"stream": True})
        assert not stream_requested({"stream": "true"})
        assert not stream_requested({})

    @pytest.mark.parametrize(
        ("options", "expected"),
        [
            (None, False),
            ({}, False),
            ({"include_usage": False}, False),
            ({"include_usage": True}, True),
            ({"chunk_include_usage": True}, True),
            ("include_usage", False),
        ],
    )
    def test_wants_usage(self, options: Any, expected: bool) -> None:
        """include_usage or Ark's chunk_include_usage mean the caller already gets usage."""
        body = {"stream": True} if options is None else {"stream": True, "stream_options": options}
        assert wants_usage(body) is expected


class TestWithUsageRequested:
    def test_switches_include_usage_on(self) -> None:
        """The re-encoded body asks for usage."""
        body = json.loads(with_usage_requested({"model": "m", "stream": True}))
        assert body == {"model": "m", "stream": True, "stream_options": {"include_usage": True}}

    def test_keeps_other_stream_options(self) -> None:
        """Other stream_options survive the rewrite."""
        request = {"model": "m", "stream": True, "stream_options": {"include_obfuscation": False, "x": 1}}
        body = json.loads(with_usage_requested(request))
        assert body["stream_options"] == {"include_obfuscation": False, "x": 1, "include_usage": True}

    def test_does_not_mutate_the_request(self) -> None:
        """The caller's parsed request is left as it was."""
        options = {"include_usage": False}
        request = {"model": "m", "stream_options": options}
        with_usage_requested(request)
        assert request == {"model": "m", "stream_options": {"include_usage": False}}

    @pytest.mark.parametrize("options", [None, "text", 5, ["include_usage"]])
    def test_non_object_stream_options_never_raise(self, options: Any) -> None:
        """A malformed stream_options cannot crash the guard after it took a hold."""
        body = json.loads(with_usage_requested({"model": "m", "stream_options": options}))
        assert body["stream_options"] == {"include_usage": True}

    def test_keeps_non_ascii_text(self) -> None:
        """Chinese prompts go out as UTF-8, not as escapes the provider would count differently."""
        raw = with_usage_requested({"model": "m", "messages": [{"role": "user", "content": "你好"}]})
        assert "你好".encode() in raw

    @given(
        st.dictionaries(
            st.text(min_size=1).filter(lambda key: key != "stream_options"),
            st.recursive(
                st.none() | st.booleans() | st.integers() | st.text(),
                lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(), inner, max_size=3),
                max_leaves=8,
            ),
            max_size=6,
        )
    )
    def test_everything_else_is_preserved(self, original: dict[str, Any]) -> None:
        """Apart from stream_options, the rewritten body equals the original."""
        body = json.loads(with_usage_requested(original))
        assert body.pop("stream_options") == {"include_usage": True}
        assert body == original


class TestRoute:
    ARK = "https://ark.cn-beijing.volces.com/api/v3"

    @pytest.mark.parametrize(
        ("path", "kind", "endpoint"),
        [
            ("/images/generations", "images", "images"),
            ("/contents/generations/tasks", "video", "video_task"),
            ("/context/create", "context", "context"),
            ("/batch/chat/completions", "chat", "batch_chat"),
            ("/bots/chat/completions", "chat", "bot_chat"),
            ("/batch/embeddings/multimodal", "embeddings", "batch_embeddings"),
            ("/classification", "classification", "classification"),
        ],
    )
    def test_billed_posts_are_guarded_with_their_label(self, path: str, kind: str, endpoint: str) -> None:
        """Each billed Ark POST is guarded, labelled for the ledger by what it is."""
        assert route("POST", self.ARK + path) == Route("guard", "/api/v3" + path, kind, endpoint)  # type: ignore[arg-type]

    def test_a_task_get_is_a_poll_of_that_task(self) -> None:
        """GET of one video task names the task whose hold its answer may settle."""
        found = route("GET", self.ARK + "/contents/generations/tasks/cgt-2025-abc")
        assert found is not None and (found.action, found.task_id) == ("poll", "cgt-2025-abc")

    def test_the_task_list_is_a_poll_of_every_task(self) -> None:
        """GET of the task list (with its filters) may settle any task it lists."""
        found = route("GET", self.ARK + "/contents/generations/tasks?page_size=10")
        assert found is not None and (found.action, found.task_id) == ("poll", None)

    @pytest.mark.parametrize(
        ("method", "path"),
        [
            ("GET", "/models"),
            ("GET", "/responses/resp_1"),
            ("DELETE", "/contents/generations/tasks/cgt-1"),
            ("POST", "/tokenization"),
            ("POST", "/files"),
            ("POST", "/responses/resp_1/cancel"),
        ],
    )
    def test_free_requests_pass(self, method: str, path: str) -> None:
        """Reads, deletes and POSTs that bill nothing pass untouched."""
        assert route(method, self.ARK + path) is None

    @pytest.mark.parametrize("path", ["/audio/speech", "/chat/completions/extra", "/responses/resp_1/input_items"])
    def test_unknown_posts_are_refused(self, path: str) -> None:
        """Any other POST to a guarded host is refused, naming its path."""
        assert route("POST", self.ARK + path) == Route("refuse", "/api/v3" + path)

    def test_unknown_posts_elsewhere_pass(self) -> None:
        """Hosts that are not guarded are none of quotawrap's business."""
        assert route("POST", "https://api.example.com/v1/audio/speech") is None

    def test_unknown_posts_under_a_base_url_are_refused(self) -> None:
        """A --base-url host is guarded like Ark: its unknown POSTs are refused too."""
        found = route("POST", "http://127.0.0.1:9/v1/audio/speech", ["http://127.0.0.1:9/v1"])
        assert found is not None and found.action == "refuse"

    @pytest.mark.parametrize("pattern", ["/audio/speech", "audio/speech/", "/api/v3/audio/*", "*speech"])
    def test_allow_path_by_suffix_or_glob(self, pattern: str) -> None:
        """--allow-path matches a path suffix at a / boundary, or a glob over the whole path."""
        assert route("POST", self.ARK + "/audio/speech", allow_paths=[pattern]) is None

    @pytest.mark.parametrize("pattern", ["/audio", "dio/speech", "/api/v3/images/*", "/"])
    def test_allow_path_does_not_match_more(self, pattern: str) -> None:
        """A suffix must start at a path segment; an empty pattern allows nothing."""
        assert route("POST", self.ARK + "/audio/speech", allow_paths=[pattern]) is not None

    def test_allow_path_cannot_unguard_a_billed_endpoint(self) -> None:
        """A billed endpoint stays guarded whatever --allow-path says."""
        found = route("POST", self.ARK + "/chat/completions", allow_paths=["*"])
        assert found is not None and found.action == "guard"


class TestRouter:
    BASE = "http://127.0.0.1:8000/api/v3"

    def test_answers_as_route_and_remembers_per_url(self) -> None:
        """The guard asks twice per call (wants, admission): the second answer is the one remembered."""
        router = Router((self.BASE,), ("/free",))
        for method, url in (
            ("POST", self.BASE + "/chat/completions"),
            ("POST", self.BASE + "/free"),
            ("POST", self.BASE + "/unknown"),
            ("GET", self.BASE + "/contents/generations/tasks/cgt-1"),
            ("POST", "https://example.com/v1/chat/completions"),
        ):
            first = router(method, url)
            assert first == route(method, url, (self.BASE,), ("/free",))
            assert router(method, url) is first

    def test_an_unreadable_url_raises_every_time(self) -> None:
        router = Router((self.BASE,), ())
        for _ in range(2):
            with pytest.raises(ValueError):
                router("POST", "http://[::1/api/v3/chat/completions")


class TestNumbersThatAreNotJson:
    """Python reads NaN/Infinity and turns 1e400 into inf, which its encoder writes back as Infinity: refused."""

    @pytest.mark.parametrize(
        ("body", "reason"),
        [
            (b'{"model":"m","temperature":1e400}', "out of range of a 64-bit float: 1e400"),
            (b'{"model":"m","temperature":-1E+999}', "out of range"),
            (b'{"model":"m","temperature":NaN}', "not JSON: NaN"),
            (b'{"model":"m","x":[Infinity]}', "not JSON: Infinity"),
            (b' {"model":"m","x":{"y":-Infinity}}', "not JSON: -Infinity"),
        ],
    )
    def test_refused_with_a_reason(self, body: bytes, reason: str) -> None:
        with pytest.raises(ValueError, match=reason):
            parse_json_body(body)

    def test_finite_numbers_read_as_before(self) -> None:
        body = b'{"model":"m","temperature":0.7,"top_p":1E-3,"n":2,"big":123456789012345678901234567890,"z":-0.0}'
        assert parse_json_body(body) == json.loads(body)


class TestPathsAsTheRouterReadsThem:
    ARK = "https://ark.cn-beijing.volces.com/api/v3"

    @pytest.mark.parametrize(
        "path",
        [
            "//chat//completions",
            "/chat/completions/",
            "/chat%2Fcompletions",
            "/x/../chat/completions",
            "/./chat/completions",
        ],
    )
    def test_spellings_of_chat_are_chat(self, path: str) -> None:
        """Repeated slashes, dot segments and escaped slashes: the path a router matches, guarded as chat."""
        found = route("POST", self.ARK + path)
        assert found is not None and (found.action, found.kind, found.endpoint) == ("guard", "chat", "chat")

    def test_a_base_url_left_through_dot_segments_is_still_under_it(self) -> None:
        found = route("POST", "http://127.0.0.1:9/other/../v1/chat/completions", ["http://127.0.0.1:9/v1"])
        assert found is not None and found.action == "guard"

    def test_clean_path(self) -> None:
        assert clean_path("") == "" and clean_path("/") == "" and clean_path("/../..") == ""
        assert clean_path("/api//v3/./chat/../chat/completions/") == "/api/v3/chat/completions"


class TestOtherMethodsOnBilledPaths:
    ARK = "https://ark.cn-beijing.volces.com/api/v3"

    @pytest.mark.parametrize("method", ["PUT", "PATCH", "GET", "DELETE", "HEAD", "OPTIONS", "put"])
    @pytest.mark.parametrize("path", ["/chat/completions", "/embeddings", "/images/generations", "//chat//completions"])
    def test_refused_with_405(self, method: str, path: str) -> None:
        """Only POST is billed there: any other method is answered 405 by quotawrap, never sent."""
        found = route(method, self.ARK + path)
        assert found is not None and found.action == "wrong_method"

    def test_polls_and_reads_elsewhere_still_pass(self) -> None:
        assert route("GET", self.ARK + "/contents/generations/tasks").action == "poll"  # type: ignore[union-attr]
        assert route("DELETE", self.ARK + "/contents/generations/tasks/cgt-1") is None
        assert route("GET", self.ARK + "/responses/resp_1") is None
        assert route("PUT", "https://api.example.com/v1/chat/completions") is None  # not a guarded host
