"""Settings load/save: round trip, and garbage never stops the app."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ds4desk.settings import Settings


def test_defaults() -> None:
    settings = Settings()
    assert (settings.device, settings.context, settings.chunk) == ("auto", 4096, 0)  # 0: automatic
    assert (settings.temperature, settings.top_p, settings.top_k) == (0.7, 0.95, 0)
    assert settings.max_new_tokens == 1024 and settings.last_model is None


def test_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "config" / "settings.json"
    saved = Settings(
        device="cuda:1",
        dtype="bfloat16",
        temperature=0.2,
        top_k=40,
        last_model="/m/qwen",
        system_prompt="Be brief.",
    )
    saved.save(path)
    assert Settings.load(path) == saved
    assert [p.name for p in path.parent.iterdir()] == ["settings.json"]  # no temp file left behind


def test_missing_file_gives_defaults(tmp_path: Path) -> None:
    assert Settings.load(tmp_path / "nope.json") == Settings()


@pytest.mark.parametrize("garbage", [b"{not json", b"\xff\xfe\x00", b"[1, 2, 3]", b"null", b""])
def test_garbage_file_gives_defaults(tmp_path: Path, garbage: bytes) -> None:
    path = tmp_path / "settings.json"
    path.write_bytes(garbage)
    assert Settings.load(path) == Settings()


def test_bad_values_fall_back_one_by_one(tmp_path: Path) -> None:
    path = tmp_path / "settings.json"
    path.write_text(
        json.dumps(
            {
                "device": "tpu",
                "dtype": "int3",
                "context": -5,
                "chunk": "big",
                "temperature": 0.3,  # good: kept
                "top_p": 7,
                "top_k": True,
                "max_new_tokens": 256,  # good: kept
                "last_model": 42,
                "system_prompt": ["x"],
                "from_a_future_version": {"a": 1},
            }
        )
    )
    loaded = Settings.load(path)
    assert loaded == Settings(temperature=0.3, max_new_tokens=256)


def test_requests_from_settings() -> None:
    settings = Settings(
        device="cpu", dtype="auto", context=2048, chunk=64, last_model="/m/a", temperature=0.0
    )
    request = settings.load_request()
    assert (request.path, request.device, request.dtype, request.context, request.chunk) == (
        "/m/a",
        "cpu",
        None,
        2048,
        64,
    )
    override = settings.load_request("/m/b", "cuda:0")
    assert (override.path, override.device) == ("/m/b", "cuda:0")
    assert settings.sampling().greedy


def test_engine_options_follow_the_settings(tmp_path: Path) -> None:
    assert Settings().engine_options() == {
        "unpark_on_generate": True,
        "park_cancels_running": False,
        "idle_park_after_s": None,
        "snapshot_slots": 16,
        "snapshot_budget_bytes": 4096 * 2**20,
    }
    path = tmp_path / "settings.json"
    path.write_text(
        '{"idle_park_minutes": 2, "park_cancels_running": true, '
        '"snapshot_slots": 0, "unpark_on_generate": "no"}'
    )
    options = Settings.load(path).engine_options()
    assert options["idle_park_after_s"] == 120.0 and options["park_cancels_running"] is True
    assert options["snapshot_slots"] == 16 and options["unpark_on_generate"] is True  # bad values: defaults


def test_weights_default_to_as_stored_and_reach_the_load_request() -> None:
    assert Settings().weights == "as-stored"
    assert Settings().load_request().weights == "as-stored"
    assert Settings(weights="q4").load_request("/m/b", "cuda:0").weights == "q4"


@pytest.mark.parametrize("mode", ["as-stored", "q8", "q4"])
def test_weights_persist_in_the_settings_file(tmp_path: Path, mode: str) -> None:
    path = tmp_path / "settings.json"
    Settings(weights=mode).save(path)
    assert json.loads(path.read_text())["weights"] == mode
    assert Settings.load(path).weights == mode


@pytest.mark.parametrize("bad", ["q3", "Q8", "", None, 8, ["q4"]])
def test_a_bad_weights_value_falls_back_to_as_stored(tmp_path: Path, bad: object) -> None:
    path = tmp_path / "settings.json"
    path.write_text(json.dumps({"weights": bad, "context": 1024}))
    loaded = Settings.load(path)
    assert (loaded.weights, loaded.context) == ("as-stored", 1024)
