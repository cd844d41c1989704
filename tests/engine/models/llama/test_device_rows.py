"""A dense model's Q8_0 weights on a GPU are held as Q8_0_ROWS (models/packed.hold_device_rows): the
codes of each row apart from their scales, for the one-row GEMV's 16-byte loads. The model on them
answers as on the file's blocks: a prompt's logits and graphed one-token decode steps (each linear,
the fused q/k/v and gate/up groups, the embedding lookup and the tied head on the rearranged rows).
On a GPU the real kernels run; without one, the check runs them in Triton's interpreter."""

from __future__ import annotations

from tests.engine.triton_check import run_triton_check

_CHECK = """
import tempfile
from pathlib import Path

import torch

from ds4desk.engine.formats import ROW_LAYOUTS
from ds4desk.engine.kernels.dense import decode_attention, gemv
from ds4desk.engine.kernels.quant import gguf_triton as gt
from ds4desk.engine.loader import fill, plan_load
from ds4desk.engine.loading.detect import read_source
from ds4desk.engine.models.packed import PackedEmbedding, PackedLinear
from tests.engine.tiny_dense import save_tiny

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
folder = Path(tempfile.mkdtemp())
# Rows of 256 and 512 values (whole 256-value multiples: every Q8_0 weight is rearranged), tied head.
wide = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2}
save_tiny("qwen2", folder, seed=4, tie_word_embeddings=True, **wide)
prompt = torch.tensor([5, 17, 200, 3, 99, 42, 7, 180, 64, 11])


def run(rows: bool):
    # Off: the file's blocks on the reference path (the CPU kernels on a CPU), decode in torch ops.
    for switch in (gt.SWITCH, gemv.SWITCH, decode_attention.SWITCH):
        switch.forced = rows
    model = fill(plan_load(read_source(folder), device, torch.float32, 64, weights="q8")).model
    packed = [m for m in model.modules() if isinstance(m, (PackedLinear, PackedEmbedding))]
    types = {m.type_id for m in packed}
    assert types == ({ROW_LAYOUTS[8][0].type_id} if rows else {8}), types  # Q8_0 (id 8)
    model.allocate_cache(64)
    logits = [model.forward(prompt.to(device), 0, "all")]
    token = logits[0][-1].argmax().view(1)
    for pos in range(len(prompt), len(prompt) + 3):  # the graphed step: the one-row GEMVs
        logits.append(model.decode_graphable(token, torch.tensor([pos], device=device), 64))
        token = logits[-1].argmax().view(1)
    return len(packed), logits


count, got = run(True)
_, want = run(False)
assert count == 2 * 7 + 1, count  # seven linears a layer and the tied embedding
for step, (a, b) in enumerate(zip(got, want)):
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=f"step {step}")
print("rows model ok")
"""


def test_a_q8_0_model_on_rows_answers_as_on_the_files_blocks() -> None:
    assert "rows model ok" in run_triton_check(_CHECK)
