"""ds4desk on DeepSeek-V4 GGUF files made by llama.cpp's tools, scored by llama.cpp itself on the same
files (llama-cpp-python built from the same tree, CPU): teacher-forced top-1 agreement over 140
positions, against transformers' own agreement with llama.cpp (transformers holding exactly the
file's values, in float32).

llama.cpp rounds activations before its quantized (and bf16) matmuls, and a random tiny model is
sensitive to that (a router pick flips, the logits move by units), so on the quantized files
transformers agrees with llama.cpp at only ~83-86 % of the positions; ds4desk must do as well. On
the F32 file llama.cpp computes in float32 bar its bf16 router: there both must agree nearly
always, which is what shows ds4desk reads llama.cpp's layout as llama.cpp means it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from ds4desk.engine.loader import load_model
from ds4desk.engine.loading.detect import read_source
from tests.engine.loading import deepseek4_files as files

pytest.importorskip("transformers")
llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not importable")
if files.llama_cpp_tree() is None:
    pytest.skip(
        "llama.cpp's converter is absent: run scripts/llama_cpp_tree.sh (or set DS4DESK_LLAMA_CPP_TREE)",
        allow_module_level=True,
    )

LENGTH = 140  # the HCA window (128) closes, CSA's (4) many times, the raw window (8) wraps
IDS = torch.randint(1000, 100_000, (LENGTH,), generator=torch.Generator().manual_seed(1))
# A misread file (a swapped or mis-scaled tensor) agrees at a few percent of the positions.
FLOOR = {"F32": 0.95}
QUANTIZED_FLOOR = 0.7


@pytest.fixture(autouse=True)
def two_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return files.tiny_files(tmp_path_factory.getbasetemp() / "deepseek4_gguf")


def _llama_cpp_logits(path: Path) -> np.ndarray:
    llm = llama_cpp.Llama(
        model_path=str(path),
        n_ctx=LENGTH + 16,
        n_batch=LENGTH + 16,
        n_ubatch=LENGTH + 16,
        logits_all=True,
        n_threads=2,
        verbose=False,
    )
    try:
        llm.eval(IDS.tolist())
        return np.array(llm.scores[:LENGTH], dtype=np.float32)
    finally:
        llm.close()


@pytest.mark.parametrize("name", files.FILES)
def test_agreement_with_llama_cpp_is_at_least_transformers(paths: dict[str, Path], name: str) -> None:
    theirs = _llama_cpp_logits(paths[name]).argmax(axis=1)
    reference = files.reference_logits(paths[name], IDS).numpy().argmax(axis=1)
    model = load_model(read_source(paths[name]), torch.device("cpu"), torch.float32).model
    model.allocate_cache(LENGTH)
    with torch.no_grad():
        ours = model.forward(IDS, 0, "all")
    assert ours is not None
    ours_agree = float((ours.numpy().argmax(axis=1) == theirs).mean())
    transformers_agree = float((reference == theirs).mean())
    agreement = f"ds4desk {ours_agree:.3f}, transformers {transformers_agree:.3f}"
    print(f"{name}: top-1 agreement with llama.cpp: {agreement}")
    assert ours_agree >= transformers_agree
    assert ours_agree >= FLOOR.get(name, QUANTIZED_FLOOR)
