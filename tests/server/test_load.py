"""Load on a real `ds4desk serve` process (the embedded SmolLM2 on the CPU): 32 clients of the
official `openai` package send 1,000 mixed requests (chat and completions, streamed and not) at
once. Every request is answered with exactly the text the same request gets alone (greedy), so no
stream is lost or crossed, and the server's memory stays flat from the first hundreds to the last."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest

from tests.server.conftest import API_KEY, Served, serving

CLIENTS = 32
REQUESTS = 1000
WARM = 200  # requests after which the resident memory is taken as the baseline
SUBJECTS = ("the sea", "a forest", "the moon", "bread", "a river", "snow", "a city at night", "tea")
# Growth allowed from the baseline to the end: what the allocator may still round up, far below
# what keeping anything per request (a snapshot, a stream buffer, a metrics sample) would add.
FLAT_BYTES = 48 * 2**20


@dataclass(frozen=True, slots=True)
class Ask:
    subject: str
    chat: bool
    stream: bool
    max_tokens: int


ASKS = [
    Ask(subject, chat, stream, 3 + (i + int(chat) + 2 * int(stream)) % 4)
    for i, subject in enumerate(SUBJECTS)
    for chat in (True, False)
    for stream in (True, False)
]


def answer(client: openai.OpenAI, model: str, ask: Ask) -> str:
    if ask.chat:
        messages = [{"role": "user", "content": f"Write one sentence about {ask.subject}."}]
        common = dict(model=model, messages=messages, max_tokens=ask.max_tokens, temperature=0)
        if not ask.stream:
            return client.chat.completions.create(**common).choices[0].message.content or ""  # type: ignore[call-overload]
        chunks = client.chat.completions.create(**common, stream=True)  # type: ignore[call-overload]
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    common = dict(
        model=model, prompt=f"A short note about {ask.subject}:", max_tokens=ask.max_tokens, temperature=0
    )
    if not ask.stream:
        return client.completions.create(**common).choices[0].text  # type: ignore[call-overload]
    chunks = client.completions.create(**common, stream=True)  # type: ignore[call-overload]
    return "".join(c.choices[0].text for c in chunks if c.choices)


def resident_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.fixture(scope="module")
def loaded_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    home = tmp_path_factory.mktemp("load-home")
    # One engine thread: the 32 clients live in this process and take a core of the two, and the
    # engine's threads then wait on each other (spinning) for every layer.
    with serving(home, home / "stderr.txt", "--context", "512", env={"OMP_NUM_THREADS": "1"}) as served:
        yield served


def test_1000_requests_from_32_clients(loaded_server: Served) -> None:
    if not Path("/proc/self/status").exists():
        pytest.skip("reads the server's memory from /proc")
    assert loaded_server.pid is not None
    alone_client = openai.OpenAI(base_url=loaded_server.base_url, api_key=API_KEY, max_retries=0, timeout=300)
    alone = {ask: answer(alone_client, loaded_server.model, ask) for ask in ASKS}
    assert all(alone.values()) and len(set(alone.values())) > len(ASKS) // 2  # real, varied answers

    lock = threading.Lock()
    done: list[tuple[Ask, str]] = []
    failures: list[str] = []
    baseline: list[int] = []

    def client_thread(number: int) -> None:
        client = openai.OpenAI(base_url=loaded_server.base_url, api_key=API_KEY, max_retries=0, timeout=600)
        for index in range(number, REQUESTS, CLIENTS):
            ask = ASKS[(index * 7 + number) % len(ASKS)]
            try:
                text = answer(client, loaded_server.model, ask)
            except Exception as exc:  # reported below with the request that failed
                with lock:
                    failures.append(f"{ask}: {type(exc).__name__}: {exc}")
                continue
            with lock:
                done.append((ask, text))
                if len(done) == WARM:
                    baseline.append(resident_bytes(loaded_server.pid))

    threads = [threading.Thread(target=client_thread, args=(n,)) for n in range(CLIENTS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    end = resident_bytes(loaded_server.pid)

    assert failures == []
    assert len(done) == REQUESTS
    crossed = [(ask, text) for ask, text in done if text != alone[ask]]
    assert crossed == []
    assert end - baseline[0] < FLAT_BYTES, f"resident memory grew {(end - baseline[0]) / 2**20:.1f} MiB"
