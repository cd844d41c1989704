"""Plain HTTP at a real `ds4desk serve`: malformed, oversized and unauthorised requests get an
OpenAI-style JSON error with a 4xx status, and the server keeps answering."""

from __future__ import annotations

import http.client
import json
from pathlib import Path

import pytest

from tests.server.conftest import API_KEY, Served, ds4desk

GOOD = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0}


def send(
    server: Served,
    method: str,
    path: str,
    body: bytes | None = None,
    key: str | None = API_KEY,
    **headers: str,
) -> tuple[int, dict]:
    connection = http.client.HTTPConnection(server.host, server.port, timeout=120)
    try:
        sent = {"Content-Type": "application/json", **headers}
        if key is not None:
            sent["Authorization"] = f"Bearer {key}"
        connection.request(method, path, body=body, headers=sent)
        response = connection.getresponse()
        raw = response.read()
    finally:
        connection.close()
    assert b"Traceback" not in raw
    return response.status, json.loads(raw)


def assert_openai_error(status: int, answer: dict, expected_status: int, mentions: str) -> None:
    assert status == expected_status, answer
    error = answer["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and mentions in error["message"]


@pytest.mark.parametrize(
    ("body", "mentions"),
    [
        (b"{not json", "not valid JSON"),
        (b"[1, 2]", "JSON object"),
        (b"\xff\xfe{}", "UTF-8"),
        (b'{"messages": [{"role": "user", "content": "Hi"}], "temperature": NaN}', "NaN"),
        (b'{"messages": [{"role": "user", "content": "Hi"}], "temperature": 1e999}', "out of range"),
        (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
        (json.dumps({"messages": "Hi"}).encode(), "messages"),
        (json.dumps({"messages": []}).encode(), "messages"),
        (json.dumps({"messages": [{"role": "wizard", "content": "Hi"}]}).encode(), "role"),
        (json.dumps({"messages": [{"role": "user", "content": 5}]}).encode(), "content"),
        (json.dumps({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}).encode(), "text"),
        (json.dumps({**GOOD, "max_tokens": -1}).encode(), "max_tokens"),
        (json.dumps({**GOOD, "max_tokens": 0}).encode(), "max_tokens"),
        (json.dumps({**GOOD, "max_tokens": True}).encode(), "max_tokens"),
        (json.dumps({**GOOD, "max_tokens": 10**30}).encode(), "max_tokens"),
        (json.dumps({**GOOD, "temperature": "hot"}).encode(), "temperature"),
        (json.dumps({**GOOD, "temperature": 3}).encode(), "temperature"),
        (json.dumps({**GOOD, "top_p": -0.5}).encode(), "top_p"),
        (json.dumps({**GOOD, "seed": -1}).encode(), "seed"),
        (json.dumps({**GOOD, "stop": ["a", "b", "c", "d", "e"]}).encode(), "stop"),
        (json.dumps({**GOOD, "stop": [""]}).encode(), "stop"),
        (json.dumps({**GOOD, "stream": "yes"}).encode(), "stream"),
        (json.dumps({**GOOD, "n": 3}).encode(), "n = 1"),
        (json.dumps({**GOOD, "logprobs": True, "top_logprobs": 99}).encode(), "top_logprobs"),
    ],
)
def test_a_malformed_request_is_a_400(server: Served, body: bytes, mentions: str) -> None:
    status, answer = send(server, "POST", "/v1/chat/completions", body)
    assert_openai_error(status, answer, 400, mentions)
    assert answer["error"]["type"] == "invalid_request_error"


def test_a_body_over_the_limit_is_refused_before_it_is_read(server: Served) -> None:
    huge = json.dumps({**GOOD, "padding": "x" * (9 * 2**20)}).encode()
    status, answer = send(server, "POST", "/v1/chat/completions", huge)
    assert_openai_error(status, answer, 413, "limited to")


@pytest.mark.parametrize("length", ["9" * 5000, "12abc", "-1"])
def test_a_length_header_that_is_no_small_number_is_refused(server: Served, length: str) -> None:
    connection = http.client.HTTPConnection(server.host, server.port, timeout=120)
    try:
        connection.putrequest("POST", "/v1/chat/completions")
        connection.putheader("Authorization", f"Bearer {API_KEY}")
        connection.putheader("Content-Length", length)
        connection.endheaders(b"{}")
        response = connection.getresponse()
        status, raw = response.status, response.read()
    finally:
        connection.close()
    assert status in (400, 413), raw  # uvicorn's own parser may refuse it first, with a 400
    assert b"Traceback" not in raw and status != 500


def test_a_chunked_body_over_the_limit_is_refused(server: Served) -> None:
    connection = http.client.HTTPConnection(server.host, server.port, timeout=120)
    pieces = [b"x" * 2**20] * 9  # no Content-Length: the limit is counted as it arrives
    connection.request(
        "POST",
        "/v1/chat/completions",
        body=iter(pieces),
        headers={"Authorization": f"Bearer {API_KEY}"},
        encode_chunked=True,
    )
    try:
        response = connection.getresponse()
        status, answer = response.status, json.loads(response.read())
    finally:
        connection.close()
    assert_openai_error(status, answer, 413, "limited to")


def test_without_the_key_nothing_but_health_answers(server: Served) -> None:
    body = json.dumps(GOOD).encode()
    for key in (None, "wrong", API_KEY + "x", ""):
        status, answer = send(server, "POST", "/v1/chat/completions", body, key=key)
        assert_openai_error(status, answer, 401, "API key")
        status, answer = send(server, "GET", "/v1/models", key=key)
        assert_openai_error(status, answer, 401, "API key")
    status, answer = send(server, "GET", "/health", key=None)
    assert status == 200 and answer["status"] == "ok" and answer["model"] == server.model


def test_unknown_routes_and_methods_are_json_errors(server: Served) -> None:
    status, answer = send(server, "GET", "/v1/nothing")
    assert_openai_error(status, answer, 404, "Not Found")
    status, answer = send(server, "GET", "/v1/chat/completions")
    assert_openai_error(status, answer, 405, "Method Not Allowed")


def test_the_server_still_answers_after_all_that(server: Served) -> None:
    status, answer = send(server, "POST", "/v1/chat/completions", json.dumps(GOOD).encode())
    assert status == 200, answer
    assert answer["choices"][0]["message"]["content"]
    assert answer["usage"]["completion_tokens"] <= 2


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.168.1.10", "example.com"])
def test_a_host_beyond_loopback_needs_a_key(ds4_home: Path, host: str) -> None:
    out = ds4desk("serve", "--host", host, "--port", "0", home=ds4_home, timeout=120)
    assert out.returncode == 2
    assert "--api-key" in out.stderr
    assert "Traceback" not in out.stderr


def test_an_empty_key_is_no_key(ds4_home: Path) -> None:
    out = ds4desk("serve", "--host", "0.0.0.0", "--api-key", " ", "--port", "0", home=ds4_home, timeout=120)
    assert out.returncode == 2
    assert "empty" in out.stderr


def test_serve_is_a_verb_with_its_options(ds4_home: Path) -> None:
    top = ds4desk("--help", home=ds4_home, timeout=120)
    assert top.returncode == 0 and "serve" in top.stdout
    out = ds4desk("serve", "--help", home=ds4_home, timeout=120)
    assert out.returncode == 0
    for option in ("--host", "--port", "--api-key", "--device", "--context", "--weights"):
        assert option in out.stdout
