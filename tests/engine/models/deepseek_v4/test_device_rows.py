"""A DeepSeek-V4 GGUF's Q8_0 linears on a GPU are held as Q8_0_ROWS (models/packed.hold_device_rows),
the grouped output projection's first half too (its one-row product: the rows GEMV on stacked
matrices). The model on them answers as on the file's blocks: a prompt's logits and
graphable decode steps. The file is bench/flash_gguf.py's (Q8_0 linears, Q2_K / Q3_K experts) at
its tiny size. On a GPU the real kernels run; without one, the check runs them in Triton's
interpreter."""

from __future__ import annotations

from tests.engine.triton_check import run_triton_check

_CHECK = """
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, "bench")
from flash_gguf import write
from flash_one_gpu import geometry

from ds4desk.engine.formats import ROW_LAYOUTS
from ds4desk.engine.kernels.quant import gguf_triton as gt
from ds4desk.engine.loader import load_model
from ds4desk.engine.loading.detect import read_source
from ds4desk.engine.models.packed import PackedEmbedding, PackedLinear

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
path = Path(tempfile.mkdtemp()) / "flash-3-layers.gguf"
# 8 heads of 64 in 2 groups: the grouped output projection's rows are 256 values, a row layout's
config = geometry(3, tiny=True) | {"num_attention_heads": 8}
write(path, config, {"gate_proj": "Q2_K", "up_proj": "Q2_K", "down_proj": "Q3_K"})
prompt = torch.tensor([5, 17, 200, 3, 99])
ROWS = ROW_LAYOUTS[8][0].type_id


def run(rows: bool):
    gt.SWITCH.forced = rows  # off: the file's blocks on the reference path
    model = load_model(read_source(path), device, torch.float32).model
    packed = {n: m for n, m in model.named_modules() if isinstance(m, (PackedLinear, PackedEmbedding))}
    types = {name: m.type_id for name, m in packed.items()}
    # Rearranged: rows of 256-value multiples.
    expected = {}
    for name, m in packed.items():
        cols = m.in_features if isinstance(m, PackedLinear) else m.embedding_dim
        expected[name] = ROWS if cols % 256 == 0 else 8
    model.allocate_cache(64)
    with torch.inference_mode():
        logits = [model.forward(prompt.to(device), 0, "all")]
        token = logits[0][-1].argmax().view(1)
        for pos in range(len(prompt), len(prompt) + 2):
            logits.append(model.decode_graphable(token, torch.tensor([pos], device=device), 64))
            token = logits[-1].argmax().view(1)
    return types, expected, logits


types, expected, got = run(True)
plain, _, want = run(False)
assert set(plain.values()) == {8}, plain  # every packed linear of the file is Q8_0
assert types == expected, (types, expected)
assert "lm_head" in types and list(types.values()).count(ROWS) > len(types) // 2
assert all(types[n] == ROWS for n in types if n.endswith("o_a_proj")), types
for step, (a, b) in enumerate(zip(got, want)):
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=f"step {step}")
print("rows model ok")
"""


def test_a_v4_gguf_on_rows_answers_as_on_the_files_blocks() -> None:
    out = run_triton_check(_CHECK)
    assert "rows model ok" in out, out
