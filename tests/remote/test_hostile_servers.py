"""RemoteEngine against broken and hostile servers (a real HTTP server on a real socket, scripted by
each test): every answer ends, with a clear error and the text that had arrived."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from ds4desk.engine.api import ErrorCode, FinishReason, GenerateRequest, GenerateResult
from ds4desk.remote import RemoteConfig, RemoteEngine
from tests.remote.stub import Handler, content, reasoning, stub_server, usage

MESSAGES = [{"role": "user", "content": "Hi"}]


@pytest.fixture
def engines() -> Iterator[list[RemoteEngine]]:
    made: list[RemoteEngine] = []
    yield made
    for engine in made:
        engine.close()


def ask(
    engines: list[RemoteEngine],
    url: str,
    max_tokens: int = 32,
    pieces: list[str] | None = None,
    **config: object,
) -> GenerateResult:
    engine = RemoteEngine(RemoteConfig(url, **config))  # type: ignore[arg-type]
    engines.append(engine)
    sink = (lambda _token, text: pieces.append(text)) if pieces is not None else None
    return engine.generate(GenerateRequest(messages=MESSAGES, max_new_tokens=max_tokens), sink)


def test_a_well_behaved_stream_with_thinking_usage_and_done(engines: list[RemoteEngine]) -> None:
    def script(h: Handler) -> None:
        h.start_events()
        h.raw(b": keep-alive comment\n\n")
        h.event(reasoning("Let me see. "))
        h.event(reasoning("Yes."))
        h.raw(b'data: {"choices": [{"index": 0, "delta": {"content": "Hel"}}]}\r\n\r\n')  # CRLF lines
        h.event(content("lo", finish="stop"))
        h.event(usage(7, 4))
        h.event(b"[DONE]")

    pieces: list[str] = []
    with stub_server(script) as stub:
        result = ask(engines, stub.url, pieces=pieces, api_key="sekrit")
    assert result.ok, result.error
    assert result.text == "<think>Let me see. Yes.</think>\n\nHello"
    assert "".join(pieces) == result.text
    assert result.finish_reason == FinishReason.STOP
    assert (result.stats.prompt_tokens, result.stats.generated_tokens) == (7, 4)
    post = next(seen for seen in stub.seen if seen.method == "POST")
    assert post.path == "/v1/chat/completions"
    assert post.headers["Authorization"] == "Bearer sekrit"
    assert post.body["model"] == "stub-model" and post.body["stream"] is True
    assert post.body["messages"] == MESSAGES and post.body["max_tokens"] == 32
    assert post.body["stream_options"] == {"include_usage": True}


def test_invalid_json_chunk_is_an_error_that_keeps_the_text(engines: list[RemoteEngine]) -> None:
    def script(h: Handler) -> None:
        h.start_events()
        h.event(content("kept"))
        h.event(b"{not json")
        h.event(content("never"))

    with stub_server(script) as stub:
        result = ask(engines, stub.url)
    assert result.error is not None and "not JSON" in result.error.detail
    assert result.finish_reason == FinishReason.ERROR
    assert result.text == "kept"


def test_non_utf8_is_an_error(engines: list[RemoteEngine]) -> None:
    def script(h: Handler) -> None:
        h.start_events()
        h.event(content("ok "))
        h.raw(b'data: {"choices": [{"index": 0, "delta": {"content": "\xff\xfe"}}]}\n\n')

    with stub_server(script) as stub:
        result = ask(engines, stub.url)
    assert result.error is not None and "not UTF-8" in result.error.detail
    assert result.text == "ok "


def test_a_huge_line_is_refused_at_the_limit(engines: list[RemoteEngine]) -> None:
    def script(h: Handler) -> None:
        h.start_events()
        h.event(content("start"))
        h.raw(b"data: " + b"x" * (256 << 10))  # no newline in sight
        h.raw(b"\n\n")

    with stub_server(script) as stub:
        result = ask(engines, stub.url, max_line_bytes=64 << 10)
    assert result.error is not None and "longer than 65536 bytes" in result.error.detail
    assert result.text == "start"


def test_an_endless_stream_is_cut_at_max_tokens(engines: list[RemoteEngine]) -> None:
    def script(h: Handler) -> None:
        h.start_events()
        while True:  # ignores max_tokens, never finishes
            h.event(content("na "))

    pieces: list[str] = []
    with stub_server(script) as stub:
        result = ask(engines, stub.url, max_tokens=10, pieces=pieces)
        assert stub.client_left.wait(30), "the connection was not closed"
    assert result.ok, result.error
    assert result.finish_reason == FinishReason.LENGTH
    assert 10 <= len(pieces) <= 10 + 16
    assert result.text == "na " * len(pieces)


def test_an_endless_stream_of_empty_events_is_an_error(engines: list[RemoteEngine]) -> None:
    def script(h: Handler) -> None:
        h.start_events()
        while True:
            h.event({"choices": [{"index": 0, "delta": {}}]})

    with stub_server(script) as stub:
        result = ask(engines, stub.url, max_tokens=5)
    assert result.error is not None and "more than" in result.error.detail and "events" in result.error.detail


def test_an_endless_stream_of_comments_is_an_error(engines: list[RemoteEngine]) -> None:
    def script(h: Handler) -> None:
        h.start_events()
        while True:
            h.raw(b": ping\n")

    with stub_server(script) as stub:
        result = ask(engines, stub.url, max_tokens=5)
    assert result.error is not None and "lines" in result.error.detail


def test_a_trickling_server_hits_the_answer_deadline(engines: list[RemoteEngine]) -> None:
    def script(h: Handler) -> None:
        h.start_events()
        h.event(content("slow"))
        for _ in range(600):  # each read succeeds: only the whole-answer deadline ends it
            h.raw(b":")
            time.sleep(0.05)

    with stub_server(script) as stub:
        result = ask(engines, stub.url, answer_timeout_s=1.0)
    assert result.error is not None and "longer than 1 s" in result.error.detail
    assert result.text == "slow"


def test_a_silent_server_hits_the_read_timeout(engines: list[RemoteEngine]) -> None:
    release = threading.Event()

    def script(h: Handler) -> None:
        h.start_events()
        release.wait(30)

    with stub_server(script) as stub:
        result = ask(engines, stub.url, read_timeout_s=0.5)
        release.set()
    assert result.error is not None and "nothing from the server for 0.5 s" in result.error.detail


def test_the_server_dying_mid_answer_keeps_the_text(engines: list[RemoteEngine]) -> None:
    def script(h: Handler) -> None:
        h.start_events()
        h.event(content("first "))
        h.event(content("second"))
        h.close_connection = True  # and nothing more: no finish_reason, no [DONE]

    with stub_server(script) as stub:
        result = ask(engines, stub.url)
    assert result.error is not None and "closed the connection mid-answer" in result.error.detail
    assert result.text == "first second"


def test_an_error_event_mid_stream(engines: list[RemoteEngine]) -> None:
    def script(h: Handler) -> None:
        h.start_events()
        h.event(content("part"))
        h.event({"error": {"message": "out of KV cache blocks", "type": "server_error"}})

    with stub_server(script) as stub:
        result = ask(engines, stub.url)
    assert result.error is not None and "out of KV cache blocks" in result.error.detail
    assert result.text == "part"


@pytest.mark.parametrize(
    ("status", "body", "code", "words"),
    [
        (500, {"error": {"message": "CUDA error: illegal memory access"}}, ErrorCode.DECODE_FAILED, "(500)"),
        (400, {"object": "error", "message": "This model's maximum context length is 2048", "code": 400},
         ErrorCode.CONTEXT_OVERFLOW, "too long"),
        (401, {"error": "unauthorized"}, ErrorCode.BAD_REQUEST, "API key"),
        (404, {"detail": "Not Found"}, ErrorCode.BAD_REQUEST, "…/v1"),
        (503, "<html>gateway \x1b[31m down</html>", ErrorCode.DECODE_FAILED, "gateway"),
    ],
)  # fmt: skip
def test_error_statuses_become_clear_errors(
    engines: list[RemoteEngine], status: int, body: object, code: ErrorCode, words: str
) -> None:
    def script(h: Handler) -> None:
        h.send_json(status, body)

    with stub_server(script) as stub:
        result = ask(engines, stub.url)
    assert result.error is not None
    assert result.error.code == code
    assert words in result.error.detail
    assert "\x1b" not in result.error.detail  # a server's words are shown, its control codes are not


def test_a_redirect_to_another_host_is_not_followed(engines: list[RemoteEngine]) -> None:
    def elsewhere(h: Handler) -> None:
        h.start_events()
        h.event(content("stolen", finish="stop"))
        h.event(b"[DONE]")

    with stub_server(elsewhere) as other:

        def script(h: Handler) -> None:
            h.send_response(307)
            h.send_header("Location", other.url + "/chat/completions")
            h.end_headers()

        with stub_server(script) as stub:
            result = ask(engines, stub.url, api_key="sekrit")
    assert result.error is not None and "another host" in result.error.detail
    assert [seen.method for seen in other.seen] == []  # neither the key nor the chat went there
    assert result.text == ""


def test_a_redirect_within_the_server_is_followed(engines: list[RemoteEngine]) -> None:
    def script(h: Handler) -> None:
        if h.path == "/v1/chat/completions":
            h.send_response(308)
            h.send_header("Location", "/api/v1/chat/completions")
            h.end_headers()
            return
        h.start_events()
        h.event(content("moved", finish="stop"))
        h.event(b"[DONE]")

    with stub_server(script) as stub:
        result = ask(engines, stub.url, api_key="sekrit")
    assert result.ok, result.error
    assert result.text == "moved"
    followed = [seen for seen in stub.seen if seen.path == "/api/v1/chat/completions"]
    assert len(followed) == 1 and followed[0].body["messages"] == MESSAGES


def test_a_server_that_does_not_stream_answers_whole(engines: list[RemoteEngine]) -> None:
    def script(h: Handler) -> None:
        h.send_json(
            200,
            {
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "all at once"},
                             "finish_reason": "length"}],
                "usage": {"prompt_tokens": 3, "completion_tokens": 5},
            },
        )  # fmt: skip

    pieces: list[str] = []
    with stub_server(script) as stub:
        result = ask(engines, stub.url, pieces=pieces)
    assert result.ok and result.text == "all at once" and pieces == ["all at once"]
    assert result.finish_reason == FinishReason.LENGTH
    assert result.stats.generated_tokens == 5


def test_stop_closes_the_connection(engines: list[RemoteEngine]) -> None:
    first = threading.Event()

    def script(h: Handler) -> None:
        h.start_events()
        for _ in range(2000):
            h.event(content("word "))
            time.sleep(0.02)

    engine = RemoteEngine(RemoteConfig("unused"))
    engines.append(engine)
    with stub_server(script) as stub:
        engine.config.url = stub.url
        request = GenerateRequest(messages=MESSAGES, max_new_tokens=1000)
        future = engine.submit_generate(request, lambda _token, _text: first.set())
        assert first.wait(30)
        engine.cancel(request.request_id)
        result = future.result(timeout=30)
        assert stub.client_left.wait(30), "the server never saw the connection close"
    assert result.finish_reason == FinishReason.CANCELLED
    assert result.error is None  # Stop is no failure: the answer ends with what arrived
    assert result.text.startswith("word ") and len(result.text) < 1000 * len("word ")


def test_a_refused_connection_says_so(engines: list[RemoteEngine]) -> None:
    import socket

    with socket.socket() as sock:  # a port nobody listens on once this closes
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    result = ask(engines, f"http://127.0.0.1:{port}")
    assert result.error is not None and "connection refused" in result.error.detail
    assert result.finish_reason == FinishReason.ERROR


def test_bad_urls_are_refused_before_any_connection(engines: list[RemoteEngine]) -> None:
    for url in ("ftp://host/v1", "http://user:pw@host/v1", "http://:80", "http://host:99999/v1"):
        engine = RemoteEngine(RemoteConfig(url))
        engines.append(engine)
        loaded = engine.load()
        assert loaded.error is not None and loaded.error.code == ErrorCode.BAD_REQUEST, url


def test_broken_chunked_encoding_is_an_error_that_keeps_the_text(engines: list[RemoteEngine]) -> None:
    good = b'data: {"choices": [{"index": 0, "delta": {"content": "fine"}}]}\n\n'

    def script(h: Handler) -> None:
        head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
        h.raw(head + f"{len(good):x}\r\n".encode() + good + b"\r\n" + b"zz-not-a-size\r\n")
        h.close_connection = True

    with stub_server(script) as stub:
        result = ask(engines, stub.url)
    assert result.error is not None and "mid-answer" in result.error.detail  # broke off, or closed
    assert result.text == "fine"
