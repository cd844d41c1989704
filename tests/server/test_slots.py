"""GET /slots, POST /slots/{id}?action=save|restore|erase|pin|unpin, POST /park and /unpark on a real
uvicorn server over a real engine (the embedded SmolLM2), with a slot folder of the test's own; and
hostile slot requests: clear 4xx answers, nothing outside the folder touched, the server alive."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from ds4desk.engine.api import LoadRequest
from ds4desk.engine.engine import Engine
from ds4desk.server.run import ServeOptions
from tests.server.conftest import API_KEY, Served
from tests.server.inprocess import serving_in_process
from tests.server.test_hostile_requests import assert_openai_error, send

FIRST = [{"role": "user", "content": "Name a fruit."}]


@pytest.fixture(scope="module")
def slot_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("slot-home") / "slots"


@pytest.fixture(scope="module")
def served(slot_dir: Path) -> Iterator[tuple[Served, Engine]]:
    options = ServeOptions(api_key=API_KEY, slot_dir=slot_dir)
    with serving_in_process(LoadRequest(device="cpu", context=1024), options) as pair:
        yield pair


def post(server: Served, path: str, body: dict | None = None, key: str | None = API_KEY) -> tuple[int, dict]:
    return send(server, "POST", path, json.dumps(body).encode() if body is not None else None, key=key)


def listed(server: Served) -> list[dict]:
    status, answer = send(server, "GET", "/slots")
    assert status == 200, answer
    return answer["slots"]


def test_a_cached_answer_is_a_slot_that_survives_save_erase_restore(
    served: tuple[Served, Engine], slot_dir: Path
) -> None:
    server = served[0]
    client = openai.OpenAI(base_url=server.base_url, api_key=API_KEY, timeout=300, max_retries=0)
    assert listed(server) == []
    reply = client.chat.completions.create(
        model="m", messages=FIRST, max_tokens=6, temperature=0, extra_body={"cache_prompt": True}
    )
    assert reply.usage is not None
    slots = listed(server)
    assert len(slots) == 1
    slot = slots[0]
    assert 0 < slot["tokens"] <= reply.usage.total_tokens and slot["filename"] is None
    assert "path" not in slot  # the server's own paths are not shown
    kept = slot["tokens"]

    status, answer = post(server, f"/slots/{slot['slot']}?action=save", {"filename": "fruit.slot"})
    assert status == 200, answer
    assert answer["filename"] == "fruit.slot"
    assert (slot_dir / "fruit.slot").is_file()
    assert listed(server)[0]["filename"] == "fruit.slot"

    status, answer = post(server, f"/slots/{slot['slot']}?action=erase")
    assert status == 200 and answer["slots"] == [] and listed(server) == []

    status, answer = post(server, "/slots/3?action=restore", {"filename": "fruit.slot"})
    assert status == 200, answer
    assert [(s["slot"], s["tokens"], s["filename"]) for s in answer["slots"]] == [(3, kept, "fruit.slot")]

    # The next turn continues from the restored slot: the engine counts the hit.
    second = [
        *FIRST,
        {"role": "assistant", "content": reply.choices[0].message.content or ""},
        {"role": "user", "content": "And a vegetable?"},
    ]
    client.chat.completions.create(model="m", messages=second, max_tokens=3, temperature=0)
    assert listed(server)[0]["hits"] == 1

    for action in ("pin", "unpin"):
        status, answer = post(server, f"/slots/3?action={action}")
        assert status == 200 and answer["slots"][0]["pinned"] == (action == "pin")
    status, answer = post(server, "/slots/3?action=erase")
    assert status == 200 and answer["slots"] == []


def test_park_and_unpark(served: tuple[Served, Engine]) -> None:
    server = served[0]
    status, answer = post(server, "/park")
    assert status == 200, answer
    assert answer["parked"] is True and answer["bytes"] > 0
    assert send(server, "GET", "/health")[1]["parked"] is True
    status, answer = post(server, "/park?target=wizard")
    assert_openai_error(status, answer, 400, "target")
    status, answer = post(server, "/unpark")
    assert status == 200, answer
    assert answer["parked"] is False and answer["bytes"] > 0
    # Parked again, a request unparks the model by itself.
    assert post(server, "/park")[0] == 200
    status, answer = post(server, "/v1/chat/completions", {"messages": FIRST, "max_tokens": 2})
    assert status == 200, answer
    assert send(server, "GET", "/health")[1]["parked"] is False


@pytest.mark.parametrize(
    ("path", "body", "status", "mentions"),
    [
        ("/slots/0?action=save", {"filename": "../escape.slot"}, 400, "filename"),
        ("/slots/0?action=save", {"filename": "/etc/passwd"}, 400, "filename"),
        ("/slots/0?action=save", {"filename": "a/b.slot"}, 400, "filename"),
        ("/slots/0?action=save", {"filename": "a\\b.slot"}, 400, "filename"),
        ("/slots/0?action=save", {"filename": ".."}, 400, "filename"),
        ("/slots/0?action=save", {"filename": ".hidden"}, 400, "filename"),
        ("/slots/0?action=save", {"filename": "a..b"}, 400, "filename"),
        ("/slots/0?action=save", {"filename": "nul\u0000.slot"}, 400, "filename"),
        ("/slots/0?action=save", {"filename": "x" * 300}, 400, "filename"),
        ("/slots/0?action=save", {"filename": ""}, 400, "filename"),
        ("/slots/0?action=save", {"filename": 5}, 400, "filename"),
        ("/slots/0?action=save", {"filename": ["a"]}, 400, "filename"),
        ("/slots/0?action=save", {}, 400, "filename"),
        ("/slots/0?action=restore", {"filename": "missing.slot"}, 404, "no slot file"),
        ("/slots/0?action=save", {"filename": "fine.slot"}, 400, "slot"),  # slot 0 holds nothing
        ("/slots/0?action=explode", {}, 400, "action"),
        ("/slots/0", {}, 400, "action"),
        ("/slots/abc?action=erase", None, 400, "slot id"),
        ("/slots/-1?action=erase", None, 400, "slot id"),
        ("/slots/1e3?action=erase", None, 400, "slot id"),
        ("/slots/99999999999999999999999999?action=erase", None, 400, "slot id"),
        ("/slots/%D9%A3?action=erase", None, 400, "slot id"),  # an Arabic-Indic digit three
        ("/slots/%2e%2e?action=erase", None, 400, "slot id"),
    ],
)
def test_hostile_slot_requests_are_clear_4xx(
    served: tuple[Served, Engine], slot_dir: Path, path: str, body: dict | None, status: int, mentions: str
) -> None:
    server = served[0]
    before = sorted(os.listdir(slot_dir.parent))
    got, answer = post(server, path, body)
    assert_openai_error(got, answer, status, mentions)
    assert sorted(os.listdir(slot_dir.parent)) == before  # nothing written beside the slot folder
    assert send(server, "GET", "/health")[0] == 200


def test_a_body_that_is_no_json_object_is_a_400(served: tuple[Served, Engine]) -> None:
    server = served[0]
    for raw in (b"{nope", b"[1]", b'"filename"'):
        status, answer = send(server, "POST", "/slots/0?action=save", raw)
        assert_openai_error(status, answer, 400, "JSON")


def test_only_regular_files_in_the_folder_are_restored(served: tuple[Served, Engine], slot_dir: Path) -> None:
    server = served[0]
    slot_dir.mkdir(parents=True, exist_ok=True)
    outside = slot_dir.parent / "outside.slot"
    outside.write_bytes(b"not a snapshot")
    (slot_dir / "link.slot").symlink_to(outside)
    (slot_dir / "folder.slot").mkdir()
    (slot_dir / "garbage.slot").write_bytes(b"\x00" * 64)
    for name, mentions in (("link.slot", "regular file"), ("folder.slot", "regular file")):
        status, answer = post(server, "/slots/0?action=restore", {"filename": name})
        assert_openai_error(status, answer, 400, mentions)
    status, answer = post(server, "/slots/0?action=restore", {"filename": "garbage.slot"})
    assert_openai_error(status, answer, 400, "garbage.slot")
    assert str(slot_dir) not in answer["error"]["message"]  # the server's folder is not shown
    # A save onto a link is refused: it would write where the link points.
    client = openai.OpenAI(base_url=server.base_url, api_key=API_KEY, timeout=300, max_retries=0)
    client.chat.completions.create(
        model="m", messages=FIRST, max_tokens=2, temperature=0, extra_body={"cache_prompt": True}
    )
    slot = listed(server)[0]["slot"]
    status, answer = post(server, f"/slots/{slot}?action=save", {"filename": "link.slot"})
    assert status == 400, answer
    assert outside.read_bytes() == b"not a snapshot"
    assert post(server, f"/slots/{slot}?action=erase")[0] == 200


def test_slot_and_park_endpoints_need_the_key(served: tuple[Served, Engine]) -> None:
    server = served[0]
    for key in (None, "wrong"):
        assert_openai_error(*send(server, "GET", "/slots", key=key), 401, "API key")
        for path in ("/slots/0?action=erase", "/park", "/unpark"):
            assert_openai_error(*post(server, path, key=key), 401, "API key")
    assert send(server, "GET", "/health")[1]["parked"] is False


def test_without_a_slot_folder_files_are_refused(server: Served) -> None:
    """The `ds4desk serve` process of the other tests: listing works; a file name is refused with a
    400 whatever the folder (off, or the data directory's) and nothing escapes it."""
    status, answer = send(server, "GET", "/slots")
    assert status == 200 and isinstance(answer["slots"], list)
    status, answer = post(server, "/slots/0?action=save", {"filename": "../../escape.slot"})
    assert status == 400, answer
