"""Preflight (headers only) and load progress / cancel, on real tiny checkpoints and the real GGUF."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from concurrent.futures import Future
from pathlib import Path

import pytest

from ds4desk.engine import Engine, EngineClient, ErrorCode, GenerateRequest, LoadRequest, ModelPreview
from ds4desk.engine.api import WARM_UP_UNIT
from ds4desk.engine.loading.default_model import default_model_path
from ds4desk.engine.make_tiny import make_tiny
from ds4desk.engine.preflight import preview_model
from tests.engine.tiny_dense import TINY_CONFIGS, save_tiny

TOKENIZER = Path(__file__).with_name("tiny_tokenizer.json")
PROMPT = [1, 2, 3, 4, 5]


def tiny_dense(folder: Path, seed: int = 0) -> Path:
    save_tiny("llama", folder, seed=seed)
    shutil.copy(TOKENIZER, folder / "tokenizer.json")
    return folder


@pytest.fixture(scope="module")
def dense(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_dense(tmp_path_factory.mktemp("dense") / "tiny-llama")


@pytest.fixture(scope="module")
def dense_b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_dense(tmp_path_factory.mktemp("dense-b") / "tiny-llama-b", seed=1)


def assert_failed(preview: ModelPreview, *words: str) -> None:
    assert preview.error is not None and preview.error.code == ErrorCode.LOAD_FAILED
    assert not preview.fits and preview.parameters == 0
    assert preview.message == preview.error.detail
    for word in words:
        assert word in preview.message, preview.message


def test_a_dense_folder(dense: Path) -> None:
    cfg = TINY_CONFIGS["llama"]
    preview = preview_model(dense, "cpu", None, 4096)
    assert preview.error is None and preview.fits and not preview.needs_unload
    assert (preview.family, preview.architecture) == ("llama", "LlamaForCausalLM")
    assert (preview.device, preview.dtype) == ("cpu", "float32")
    assert preview.context == cfg["max_position_embeddings"]  # 4096 asked, the model stops at 256
    hidden, inter, layers, vocab = (
        cfg[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "vocab_size")
    )
    kv_dim = hidden // cfg["num_attention_heads"] * cfg["num_key_value_heads"]
    per_layer = 2 * hidden * hidden + 2 * hidden * kv_dim + 3 * hidden * inter + 2 * hidden
    params = vocab * hidden + layers * per_layer + hidden  # tied embeddings: no lm_head
    assert preview.parameters == params
    assert preview.weight_bytes == params * 4
    assert preview.cache_bytes == layers * 2 * kv_dim * 256 * 4
    assert preview.free_bytes is not None and preview.free_bytes > 0
    assert "free on cpu" in preview.message and "LlamaForCausalLM" in preview.message

    half = preview_model(dense / "model.safetensors", "cpu", "bfloat16", 64)  # a file of the folder
    assert half.ok and half.weight_bytes == params * 2 and half.cache_bytes == layers * 2 * kv_dim * 64 * 2


def test_a_deepseek_v4_folder(tmp_path: Path) -> None:
    state = make_tiny("deepseek_v4", tmp_path / "v4")
    preview = preview_model(tmp_path / "v4", "cpu", None, 128)
    assert preview.error is None and preview.fits
    assert (preview.family, preview.architecture) == ("deepseek_v4", "DeepseekV4ForCausalLM")
    assert preview.parameters == sum(t.numel() for t in state.values())
    assert preview.weight_bytes == preview.parameters * 4
    assert preview.cache_bytes > 0 and preview.context == 128


def test_the_embedded_gguf_is_read_from_its_header_only() -> None:
    preview = preview_model(default_model_path(), "cpu", None, 2048)
    assert preview.error is None and preview.fits
    assert (preview.family, preview.architecture) == ("llama", "LlamaForCausalLM")
    assert preview.parameters == 134_515_008  # SmolLM2-135M, tied embeddings
    # The weights stay in the file's block types: what the file's tensors take, not 4 bytes each.
    assert preview.stored_types == (("Q4_1", 66_355_200), ("Q8_0", 30_081_024), ("F32", 140_544))
    assert preview.weight_bytes == sum(n for _, n in preview.stored_types)
    # 30 layers, 3 KV heads of 64, float32: K and V for 2048 positions.
    assert preview.cache_bytes == 30 * 2 * 3 * 64 * 2048 * 4
    assert "as stored: Q4_1 66.4 MB, Q8_0 30.1 MB" in preview.message


def test_a_truncated_safetensors(dense: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(dense, broken)
    weights = broken / "model.safetensors"
    os.truncate(weights, weights.stat().st_size // 2)
    assert_failed(preview_model(broken, "cpu"), "model.safetensors")


def test_a_gguf_cut_in_half(tmp_path: Path) -> None:
    data = default_model_path().read_bytes()
    half = tmp_path / "half.gguf"
    half.write_bytes(data[: len(data) // 2])
    assert_failed(preview_model(half, "cpu"), "half.gguf", "truncated")


def test_random_bytes_named_gguf(tmp_path: Path) -> None:
    noise = tmp_path / "noise.gguf"
    noise.write_bytes(os.urandom(4096))
    assert_failed(preview_model(noise, "cpu"), "noise.gguf", "not a valid GGUF")


def test_a_folder_without_config(dense: Path, tmp_path: Path) -> None:
    folder = tmp_path / "no-config"
    folder.mkdir()
    shutil.copy(dense / "model.safetensors", folder)
    assert_failed(preview_model(folder, "cpu"), "no config.json")


def test_a_text_file_and_a_missing_path(tmp_path: Path) -> None:
    notes = tmp_path / "notes.txt"
    notes.write_text("hello")
    assert_failed(preview_model(notes, "cpu"), "notes.txt is not a model")
    assert_failed(preview_model(tmp_path / "gone", "cpu"), "does not exist")


def test_a_folder_without_tokenizer(dense: Path, tmp_path: Path) -> None:
    folder = tmp_path / "no-tok"
    shutil.copytree(dense, folder)
    (folder / "tokenizer.json").unlink()
    assert_failed(preview_model(folder, "cpu"), "no tokenizer.json")


def test_does_not_fit_says_what_to_do(dense: Path) -> None:
    full = preview_model(dense, "cpu", None, 256)
    needed = full.weight_bytes + full.cache_bytes
    refused = preview_model(dense, "cpu", None, 256, free_bytes=needed - 1)
    assert refused.error is None and not refused.fits and refused.free_bytes == needed - 1
    assert refused.message.startswith(f"needs {needed / 1e6:.1f} MB, ")
    assert "free on cpu: choose a smaller context, another device or a smaller model" in refused.message

    # With a model loaded on the same device, unloading it is the way: it fits, but only so.
    swap = preview_model(dense, "cpu", None, 256, free_bytes=needed - 1, resident=("cpu", 10**6))
    assert swap.fits and swap.needs_unload and "only after unloading the current model" in swap.message
    other = preview_model(dense, "cpu", None, 256, free_bytes=needed - 1, resident=("cuda:0", 10**9))
    assert not other.fits  # memory on another device does not help
    tight = preview_model(dense, "cpu", None, 256, free_bytes=1000, resident=("cpu", 10))
    assert not tight.fits and "park the current model" in tight.message

    # A context the cache cannot hold: the same refusal, from the cache size alone.
    big = tiny_config_copy(dense, max_position_embeddings=2**40)
    huge = preview_model(big, "cpu", None, 2**34)
    assert huge.error is None and not huge.fits and huge.cache_bytes > 10**12


def tiny_config_copy(folder: Path, **overrides: object) -> Path:
    copy = folder.parent / f"{folder.name}-{len(overrides)}"
    if not copy.exists():
        shutil.copytree(folder, copy)
        config = json.loads((copy / "config.json").read_text()) | overrides
        (copy / "config.json").write_text(json.dumps(config))
    return copy


def test_bad_device_and_context_are_errors_not_exceptions(dense: Path) -> None:
    assert preview_model(dense, "tpu").error is not None
    bad = preview_model(dense, "cpu", None, 1)
    assert bad.error is not None and bad.error.code == ErrorCode.BAD_REQUEST


# ---- load progress, cancel and serving during a load ---------------------------------------------


def test_progress_counts_every_tensor_and_cancel_keeps_the_previous_model(
    dense: Path, dense_b: Path, tmp_path: Path
) -> None:
    engine = Engine()
    try:
        first = engine.load(LoadRequest(path=str(dense), context=64, chunk=8))
        assert first.ok and not first.dropped_previous
        before = engine.generate(GenerateRequest(prompt_tokens=PROMPT, max_new_tokens=6))
        assert before.ok and len(before.tokens) == 6

        seen: list[tuple[int, int, str]] = []

        def cancel_after_first(done: int, total: int, unit: str) -> None:
            seen.append((done, total, unit))
            if done == 1:
                engine.cancel_load()

        cancelled = engine.load(LoadRequest(path=str(dense_b), context=64, chunk=8), cancel_after_first)
        assert cancelled.error is not None and cancelled.error.code == ErrorCode.CANCELLED
        assert "cancelled" in cancelled.error.detail
        assert seen == [(0, 0, "tensors"), (1, seen[1][1], "tensors")]  # stopped at the next tensor
        assert seen[1][1] > 2
        assert engine.model_info is not None and engine.model_info.path == str(dense)
        after = engine.generate(GenerateRequest(prompt_tokens=PROMPT, max_new_tokens=6))
        assert after.tokens == before.tokens

        # A cancel does not stick to the next load; its progress runs to the last tensor.
        progress: list[tuple[int, int, str]] = []
        second = engine.load(
            LoadRequest(path=str(dense_b), context=64, chunk=8), lambda *p: progress.append(p)
        )
        assert second.ok and engine.model_info.path == str(dense_b)
        tensors = [p for p in progress if p[2] == "tensors"]
        total = tensors[-1][1]
        assert [p[0] for p in tensors] == list(range(total + 1))
        assert {p[2] for p in progress[len(tensors) :]} == {WARM_UP_UNIT}  # then the warm-up stage
        assert total == len(dict(engine._loaded.runtime.model.named_parameters()))  # type: ignore[union-attr]
        other = engine.generate(GenerateRequest(prompt_tokens=PROMPT, max_new_tokens=6))
        assert other.ok and other.tokens != before.tokens  # really the other weights
    finally:
        engine.close()


def test_the_previous_model_answers_while_the_next_one_loads(
    dense: Path, dense_b: Path, tmp_path: Path
) -> None:
    engine = Engine()
    try:
        assert engine.load(LoadRequest(path=str(dense), context=64, chunk=8)).ok
        expected = engine.generate(GenerateRequest(prompt_tokens=PROMPT, max_new_tokens=5)).tokens
        asked: list[Future] = []
        answered_during_load: list[bool] = []

        def on_progress(done: int, total: int, unit: str) -> None:
            if unit != "tensors":  # the warm-up stage after them
                return
            if done == 1:  # sent while the load runs, like a message typed meanwhile
                asked.append(engine.submit_generate(GenerateRequest(prompt_tokens=PROMPT, max_new_tokens=5)))
            if done == total and total:
                answered_during_load.append(asked[0].done())

        loaded = engine.load(LoadRequest(path=str(dense_b), context=64, chunk=8), on_progress)
        assert loaded.ok and not loaded.dropped_previous
        assert answered_during_load == [True]
        assert asked[0].result().tokens == expected  # by the model loaded before
        assert engine.model_info.path == str(dense_b)
    finally:
        engine.close()


def test_client_preview_and_batched_progress(dense: Path, tmp_path: Path) -> None:
    engine = Engine()
    client = EngineClient(engine, updates_per_second=1)

    async def run() -> tuple[ModelPreview, ModelPreview, list[tuple[int, int, str]], object]:
        good = await client.preview(LoadRequest(path=str(dense), device="cpu", context=64))
        bad = await client.preview(LoadRequest(path=str(tmp_path / "missing"), device="cpu"))
        updates: list[tuple[int, int, str]] = []
        result = await client.load(
            LoadRequest(path=str(dense), device="cpu", context=64), lambda *p: updates.append(p)
        )
        return good, bad, updates, result

    try:
        good, bad, updates, result = asyncio.run(run())
        assert good.ok and good.fits and good.context == 64 and good.device == "cpu"
        assert bad.error is not None and "does not exist" in bad.message
        assert result.ok  # type: ignore[attr-defined]
        # Batched: the last update always arrives (flushed before the result), none arrive twice.
        assert updates and updates[-1][0] == updates[-1][1] > 0
        assert len(set(updates)) == len(updates)
        # One update a second at most: a load of a few dozen tiny tensors comes in a handful of them.
        assert len(updates) < updates[-1][1] + 1
    finally:
        engine.close()


def test_a_gguf_load_reports_progress_per_tensor_and_can_be_cancelled(dense: Path) -> None:
    engine = Engine()
    try:
        assert engine.load(LoadRequest(path=str(dense), context=64, chunk=8)).ok
        gguf = str(default_model_path())
        seen: list[tuple[int, int, str]] = []

        def cancel_at_the_second_tensor(done: int, total: int, unit: str) -> None:
            seen.append((done, total, unit))
            if done == 2:
                engine.cancel_load()

        cancelled = engine.load(LoadRequest(path=gguf, context=64), cancel_at_the_second_tensor)
        assert cancelled.error is not None and cancelled.error.code == ErrorCode.CANCELLED
        assert seen[-1][0] == 2 and seen[-1][1] == 272 and seen[-1][2] == "tensors"  # SmolLM2's tensors
        assert engine.model_info is not None and engine.model_info.path == str(dense)

        progress: list[tuple[int, int, str]] = []
        loaded = engine.load(LoadRequest(path=gguf, context=64), lambda *p: progress.append(p))
        assert loaded.ok and loaded.info is not None and loaded.info.name.startswith("SmolLM2")
        tensors = [p for p in progress if p[2] == "tensors"]
        assert [p[0] for p in tensors] == list(range(273)) and tensors[-1][1] == 272
    finally:
        engine.close()


def test_a_vision_language_config_gives_its_text_model_s_context() -> None:
    """Qwen3.5's published checkpoints keep the text model's limit inside `text_config`."""
    from ds4desk.engine.loader import clamp_context
    from ds4desk.engine.preflight import context_length

    nested = {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "text_config": {"max_position_embeddings": 1024},
    }
    assert context_length(nested) == 1024
    assert clamp_context(nested, 4096) == 1024 and clamp_context(nested, 512) == 512
    flat = {"max_position_embeddings": 2048, "text_config": {"max_position_embeddings": 1024}}
    assert context_length(flat) == 2048 and clamp_context(flat, 4096) == 2048
    assert context_length({"text_config": "not a dict"}) is None
    assert clamp_context({"max_position_embeddings": "huge"}, 4096) == 4096
