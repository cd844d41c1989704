"""GET /metrics on a real `ds4desk serve`: Prometheus' text format, read by a small strict parser (every
line a comment or `name{labels} value`, every sample of a declared family), and counters that move
with the requests the test sends."""

from __future__ import annotations

import http.client
import json
import math
import re
from dataclasses import dataclass, field

import openai
import pytest

from tests.server.conftest import API_KEY, Served
from tests.server.test_hostile_requests import send

NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
SAMPLE = re.compile(rf"^({NAME})(?:\{{(.*)\}})? (\S+)$")
LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\\n]|\\[\\"n])*)"')
TYPES = {"counter", "gauge", "histogram", "summary", "untyped"}

Labels = tuple[tuple[str, str], ...]


@dataclass(slots=True)
class Scrape:
    types: dict[str, str] = field(default_factory=dict)
    samples: dict[tuple[str, Labels], float] = field(default_factory=dict)

    def value(self, name: str, **labels: str) -> float:
        return self.samples.get((name, tuple(sorted(labels.items()))), 0.0)

    def one(self, name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        assert key in self.samples, f"no sample {key}"
        return self.samples[key]


def parse(text: str) -> Scrape:
    scrape = Scrape()
    assert text.endswith("\n")
    for number, line in enumerate(text.splitlines(), 1):
        where = f"line {number}: {line!r}"
        if line.startswith("#"):
            parts = line.split(" ", 3)
            assert parts[0] == "#" and parts[1] in ("HELP", "TYPE") and len(parts) >= 3, where
            assert re.fullmatch(NAME, parts[2]), where
            if parts[1] == "TYPE":
                assert len(parts) == 4 and parts[3] in TYPES and parts[2] not in scrape.types, where
                scrape.types[parts[2]] = parts[3]
            continue
        match = SAMPLE.match(line)
        assert match, where
        name, label_text, value_text = match.groups()
        labels: list[tuple[str, str]] = []
        if label_text is not None:
            rest = label_text
            while rest:
                label = LABEL.match(rest)
                assert label, where
                labels.append((label.group(1), label.group(2)))
                rest = rest[label.end() :]
                assert rest == "" or rest.startswith(","), where
                rest = rest[1:] if rest else rest
        family = re.sub(r"_(bucket|sum|count)$", "", name)
        assert name in scrape.types or scrape.types.get(family) == "histogram", f"undeclared: {where}"
        value = float(value_text)  # accepts +Inf, -Inf, NaN as Prometheus writes them
        key = (name, tuple(sorted(labels)))
        assert key not in scrape.samples, f"duplicate: {where}"
        scrape.samples[key] = value
    return scrape


def scrape(server: Served) -> Scrape:
    connection = http.client.HTTPConnection(server.host, server.port, timeout=120)
    try:
        connection.request("GET", "/metrics", headers={"Authorization": f"Bearer {API_KEY}"})
        response = connection.getresponse()
        raw = response.read()
        assert response.status == 200, raw
        assert response.getheader("content-type", "").startswith("text/plain; version=0.0.4")
    finally:
        connection.close()
    return parse(raw.decode("utf-8"))


@pytest.mark.parametrize(
    "bad",
    [
        "metric 1 2 3\n",
        'metric{a="1"b="2"} 1\n',
        "metric{a=1} 1\n",
        "# TYPE metric counter\nmetric one\n",
        "undeclared 1\n",
        "# TYPE metric counter\nmetric 1",
    ],
)
def test_the_parser_is_strict(bad: str) -> None:
    with pytest.raises((AssertionError, ValueError)):
        parse(bad)


def test_counters_move_with_requests(server: Served) -> None:
    client = openai.OpenAI(base_url=server.base_url, api_key=API_KEY, timeout=300, max_retries=0)
    before = scrape(server)
    chat = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Say hi."}], max_tokens=5, temperature=0
    )
    streamed = client.completions.create(
        model="m",
        prompt="Once upon a time",
        max_tokens=6,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    usages = [chunk.usage for chunk in streamed if chunk.usage is not None]
    status, _answer = send(server, "POST", "/v1/chat/completions", json.dumps({"messages": []}).encode())
    assert status == 400
    assert send(server, "GET", "/no/such/path")[0] == 404
    after = scrape(server)

    def moved(name: str, **labels: str) -> float:
        return after.value(name, **labels) - before.value(name, **labels)

    requests = "ds4desk_http_requests_total"
    assert after.types[requests] == "counter"
    assert moved(requests, endpoint="/v1/chat/completions", status="200") == 1
    assert moved(requests, endpoint="/v1/completions", status="200") == 1
    assert moved(requests, endpoint="/v1/chat/completions", status="400") == 1
    assert moved(requests, endpoint="other", status="404") == 1
    assert moved(requests, endpoint="/metrics", status="200") == 1  # the first scrape
    assert moved("ds4desk_generations_total", outcome="answered") == 2
    assert chat.usage is not None and len(usages) == 1
    tokens = chat.usage.completion_tokens + usages[0].completion_tokens
    assert moved("ds4desk_generated_tokens_total") == tokens
    assert moved("ds4desk_prompt_tokens_total") == chat.usage.prompt_tokens + usages[0].prompt_tokens
    assert after.one("ds4desk_requests_in_flight") == 0
    assert after.one("ds4desk_queue_length") == 0
    assert after.one("ds4desk_last_decode_tokens_per_second") > 0
    assert after.one("ds4desk_model_loaded") == 1 and after.one("ds4desk_model_parked") == 0
    assert after.one("ds4desk_model_weight_bytes") > 50 * 2**20  # 135M parameters, 8 bits or more
    # On the CPU, reserved is the process's resident set: a loaded model is in it.
    assert after.one("ds4desk_memory_reserved_bytes", device="cpu") > after.one("ds4desk_model_weight_bytes")
    assert after.one("ds4desk_memory_allocated_bytes", device="cpu") >= 0
    assert after.one("ds4desk_memory_total_bytes", device="cpu") >= after.one(
        "ds4desk_memory_free_bytes", device="cpu"
    )


def test_the_ttft_histogram_is_consistent(server: Served) -> None:
    client = openai.OpenAI(base_url=server.base_url, api_key=API_KEY, timeout=300, max_retries=0)
    before = scrape(server)
    client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    after = scrape(server)
    name = "ds4desk_time_to_first_token_seconds"
    assert after.types[name] == "histogram"
    assert after.one(f"{name}_count") - before.value(f"{name}_count") == 1
    assert after.one(f"{name}_sum") > before.value(f"{name}_sum")
    buckets = sorted(
        (float(dict(labels)["le"]), value) for (sample, labels), value in after.samples.items()
        if sample == f"{name}_bucket"
    )  # fmt: skip
    assert buckets[-1][0] == math.inf and buckets[-1][1] == after.one(f"{name}_count")
    counts = [count for _bound, count in buckets]
    assert counts == sorted(counts)  # cumulative
    assert 0 < after.one("ds4desk_last_time_to_first_token_seconds") <= after.one(f"{name}_sum")


def test_metrics_need_the_key(server: Served) -> None:
    status, answer = send(server, "GET", "/metrics", key=None)
    assert status == 401 and "API key" in answer["error"]["message"]
