"""The CPU prompt products as a choice (Settings > CPU prompt math, `--cpu-prefill`,
LoadRequest.cpu_prefill): parsed, saved, checked, and used by the loaded model's prompts only, with
the embedded SmolLM2 GGUF."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ds4desk.cli import build_parser, load_request_of
from ds4desk.engine import Engine, GenerateRequest, LoadRequest
from ds4desk.engine.api import CPU_PREFILL_MODES, ErrorCode
from ds4desk.engine.kernels.quant import gguf_cpu
from ds4desk.settings import Settings
from tests.engine.kernels.quant.test_gguf_cpu import smollm2_gguf


def test_the_setting_defaults_to_float32_persists_and_reaches_the_load(tmp_path: Path) -> None:
    assert Settings().load_request().cpu_prefill == "float32"
    path = tmp_path / "settings.json"
    Settings(cpu_prefill="bfloat16").save(path)
    assert json.loads(path.read_text())["cpu_prefill"] == "bfloat16"
    assert Settings.load(path).load_request("/m/x.gguf").cpu_prefill == "bfloat16"


@pytest.mark.parametrize("bad", ["bf16", "", None, 16, ["bfloat16"]])
def test_a_bad_value_in_the_file_falls_back_to_float32(tmp_path: Path, bad: object) -> None:
    path = tmp_path / "settings.json"
    path.write_text(json.dumps({"cpu_prefill": bad, "context": 1024}))
    loaded = Settings.load(path)
    assert (loaded.cpu_prefill, loaded.context) == ("float32", 1024)


@pytest.mark.parametrize("verb", [["generate", "--raw", "hi"], ["session"], ["serve"]])
def test_the_flag_reaches_the_load_request(verb: list[str]) -> None:
    parser = build_parser()
    assert load_request_of(parser.parse_args(verb)).cpu_prefill == "float32"
    for mode in CPU_PREFILL_MODES:
        assert load_request_of(parser.parse_args([*verb, "--cpu-prefill", mode])).cpu_prefill == mode


def test_the_engine_refuses_an_unknown_mode_before_touching_a_model(tmp_path: Path) -> None:
    engine = Engine()
    try:
        result = engine.load(LoadRequest(path=str(tmp_path / "no-model"), cpu_prefill="int8"))
    finally:
        engine.close()
    assert not result.ok and result.error is not None
    assert result.error.code == ErrorCode.BAD_REQUEST
    assert "'int8'" in result.error.detail and "float32, bfloat16" in result.error.detail


def first_token_logprobs(mode: str, prompt: list[int]) -> list[tuple[int, float]]:
    engine = Engine()
    try:
        loaded = engine.load(LoadRequest(device="cpu", context=256, cpu_prefill=mode, speculative="off"))
        assert loaded.ok and loaded.info is not None, loaded.error
        # The model card's figure: the products that run, bfloat16 only where the CPU has them.
        native = gguf_cpu.bf16_products_run_fast()
        assert loaded.info.cpu_prefill == ("bfloat16" if mode == "bfloat16" and native else "float32")
        result = engine.generate(
            GenerateRequest(prompt_tokens=prompt, max_new_tokens=1, stop_tokens=[], top_logprobs=5)
        )
        assert result.ok, result.error
    finally:
        engine.close()
    return [(top.token, top.logprob) for top in result.token_logprobs[0].top]


@pytest.mark.skipif(smollm2_gguf() is None, reason="the embedded SmolLM2 GGUF is not installed")
@pytest.mark.skipif(not gguf_cpu.available(), reason="the C extension is not built")
def test_bfloat16_products_run_for_the_model_that_asked_for_them() -> None:
    prompt = [(i * 7919 + 17) % 48000 + 500 for i in range(96)]  # past the few-row GEMV path
    exact = first_token_logprobs("float32", prompt)
    again = first_token_logprobs("float32", prompt)
    rounded = first_token_logprobs("bfloat16", prompt)
    assert exact == again  # the float32 products are deterministic
    assert gguf_cpu.BF16_PREFILL.forced is None  # the choice held for the prompts only
    assert [token for token, _ in rounded][:1] == [token for token, _ in exact][:1]
    if gguf_cpu.bf16_products_run_fast():
        gaps = [abs(a - b) for (_, a), (_, b) in zip(exact, rounded, strict=True)]
        assert 0 < max(gaps) < 0.1  # rounded, and only by bfloat16's rounding
    else:  # a CPU without AVX-512 BF16 keeps the exact products
        assert rounded == exact
