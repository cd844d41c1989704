"""`--weights` on the commands that load a model: parsed, checked, and carried into the LoadRequest
the command loads; the engine refuses a mode it does not know before touching any model."""

from __future__ import annotations

from pathlib import Path

import pytest

from ds4desk.cli import build_parser, load_request_of
from ds4desk.engine import Engine, LoadRequest
from ds4desk.engine.api import WEIGHT_MODES, ErrorCode


@pytest.mark.parametrize("mode", WEIGHT_MODES)
def test_generate_passes_the_weights_mode_into_its_load_request(mode: str) -> None:
    args = build_parser().parse_args(
        ["generate", "/m/llama", "--raw", "hi", "--device", "cuda:1", "--weights", mode, "--context", "512"]
    )
    request = load_request_of(args)
    assert (request.path, request.device, request.context, request.weights) == (
        "/m/llama",
        "cuda:1",
        512,
        mode,
    )


@pytest.mark.parametrize("mode", WEIGHT_MODES)
def test_session_passes_the_weights_mode_into_its_load_request(mode: str) -> None:
    args = build_parser().parse_args(["session", "/m/qwen", "--weights", mode, "--chunk", "64"])
    request = load_request_of(args)
    assert (request.path, request.chunk, request.weights) == ("/m/qwen", 64, mode)
    assert request.devices is None and request.layer_split is None


@pytest.mark.parametrize("verb", [["generate", "--raw", "hi"], ["session"]])
def test_without_the_flag_weights_load_as_stored(verb: list[str]) -> None:
    assert load_request_of(build_parser().parse_args(verb)).weights == "as-stored"


def test_generate_keeps_its_split_next_to_the_weights_mode() -> None:
    args = build_parser().parse_args(
        ["generate", "--raw", "hi", "--weights", "q4", "--devices", "cpu,cpu", "--layer-split", "2,1"]
    )
    request = load_request_of(args)
    assert (request.devices, request.layer_split, request.weights) == (("cpu", "cpu"), (2, 1), "q4")


@pytest.mark.parametrize("verb", [["generate", "--raw", "hi"], ["session"]])
def test_an_unknown_weights_mode_is_refused_naming_the_choices(
    verb: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args([*verb, "--weights", "q3"])
    assert exited.value.code == 2
    assert "'as-stored', 'q8', 'q4'" in capsys.readouterr().err


def test_the_engine_refuses_an_unknown_weights_mode(tmp_path: Path) -> None:
    engine = Engine()
    try:
        result = engine.load(LoadRequest(path=str(tmp_path / "no-model"), weights="int3"))
    finally:
        engine.close()
    assert not result.ok and result.error is not None
    assert result.error.code == ErrorCode.BAD_REQUEST
    assert "'int3'" in result.error.detail and "as-stored, q8, q4" in result.error.detail
