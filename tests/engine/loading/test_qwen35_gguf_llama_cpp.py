"""ds4desk on a tiny Qwen3.5 GGUF (dense `qwen35`, MoE `qwen35moe`), scored by llama.cpp on the same file.

The file comes from the test's own writer in llama.cpp's layout (tests/engine/models/qwen3_5/
gguf_writer.py). llama.cpp (llama-cpp-python, CPU) reads a fixed token sequence teacher-forced and
gives its logits at every position; ds4desk and transformers (holding exactly the file's values) do
the same. The figure is top-1 agreement with llama.cpp, and the bar is transformers' own: ds4desk
must agree with llama.cpp at least as often as the exact float32 computation does.

- A float32 file: llama.cpp computes in float32 too, so all three must be the same model: agreement
  near 1 and logits within a few thousandths (for the MoE model: at the positions where llama.cpp's
  router picks the same experts). This is what shows the writer's layout (and ds4desk's reading of
  it) is llama.cpp's, not merely self-consistent.
- A file of mixed block types: llama.cpp rounds the activations to 8 bits before its quantized
  matmuls, and a random tiny model is sensitive (0.4 % noise on one weight moves its logits by ~1), so
  agreement drops for transformers and ds4desk alike; only the relative bar applies, plus a floor
  that a misread file would fall through.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import MODEL_TENSOR
from gguf import GGMLQuantizationType as Q

from ds4desk.engine.loader import load_model
from ds4desk.engine.loading.detect import read_source
from tests.engine.models.qwen3_5.gguf_writer import MIXED, make_hf, write_qwen35_gguf

N_THREADS = 2  # the machine's share
SEQUENCES, LENGTH = 2, 48
CHUNK = 16


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@dataclass(slots=True, frozen=True)
class Scores:
    """Per position, the logits of llama.cpp, ds4desk and transformers [positions, V]."""

    llama_cpp: np.ndarray
    ours: np.ndarray
    transformers: np.ndarray

    def agreement(self, logits: np.ndarray) -> float:
        return float((logits.argmax(axis=1) == self.llama_cpp.argmax(axis=1)).mean())


def _sequences() -> list[list[int]]:
    generator = torch.Generator().manual_seed(7)
    # Byte-level tokens only (ids 5..260): no special token in the middle of the text.
    return [torch.randint(5, 261, (LENGTH,), generator=generator).tolist() for _ in range(SEQUENCES)]


def _llama_cpp_logits(path: Path, sequences: list[list[int]]) -> np.ndarray:
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not importable")
    try:
        llm = llama_cpp.Llama(
            model_path=str(path),
            n_ctx=LENGTH + 8,
            n_batch=LENGTH + 8,
            logits_all=True,
            n_threads=N_THREADS,
            verbose=False,
        )
    except (ValueError, RuntimeError) as exc:
        pytest.skip(f"llama.cpp refuses the tiny {path.name}: {exc}")
    rows = []
    try:
        for ids in sequences:
            llm.reset()
            llm.eval(ids)
            rows.append(np.array(llm.scores[: len(ids)], dtype=np.float32))  # a copy: eval reuses it
    finally:
        llm.close()
    return np.concatenate(rows)


def _scores(tmp: Path, moe: bool, types: dict[MODEL_TENSOR, Q] | None) -> Scores:
    hf = make_hf(moe)
    written = write_qwen35_gguf(tmp / ("moe.gguf" if moe else "dense.gguf"), hf, types)
    hf.load_state_dict(written.effective)
    sequences = _sequences()
    theirs = _llama_cpp_logits(written.path, sequences)
    model = load_model(read_source(written.path), torch.device("cpu"), torch.float32).model
    model.allocate_cache(LENGTH)
    ours, reference = [], []
    with torch.inference_mode():
        for ids in sequences:
            tensor = torch.tensor(ids)
            ours += [model.forward(tensor[s : s + CHUNK], s, "all") for s in range(0, LENGTH, CHUNK)]
            reference.append(hf(tensor[None]).logits[0].float())
    return Scores(theirs, torch.cat(ours).numpy(), torch.cat(reference).numpy())


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_a_float32_file_is_the_same_model_to_llama_cpp(tmp_path: Path, moe: bool) -> None:
    scores = _scores(tmp_path, moe, None)
    print(
        f"\nfloat32 {'moe' if moe else 'dense'}: agreement ds4desk {scores.agreement(scores.ours):.3f}, "
        f"transformers {scores.agreement(scores.transformers):.3f}, "
        f"median max |logit - llama.cpp| {np.median(np.abs(scores.ours - scores.llama_cpp).max(axis=1)):.4f}"
    )
    assert scores.agreement(scores.transformers) >= 0.95  # the writer's layout is llama.cpp's
    assert scores.agreement(scores.ours) >= scores.agreement(scores.transformers)
    # Logits within a few thousandths where the routing agrees: a MoE router's near-tie that llama.cpp's
    # summation order flips sends one position (and, through the state, a few after it) elsewhere.
    worst = np.abs(scores.ours - scores.llama_cpp).max(axis=1)
    assert (worst < 0.02).mean() >= (0.8 if moe else 1.0), worst


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_mixed_block_types_agree_with_llama_cpp_as_often_as_transformers(tmp_path: Path, moe: bool) -> None:
    scores = _scores(tmp_path, moe, MIXED)
    ours, reference = scores.agreement(scores.ours), scores.agreement(scores.transformers)
    print(f"\nmixed {'moe' if moe else 'dense'}: agreement ds4desk {ours:.3f}, transformers {reference:.3f}")
    assert reference >= 0.4  # a file llama.cpp read differently would agree about as often as chance
    assert ours >= reference
