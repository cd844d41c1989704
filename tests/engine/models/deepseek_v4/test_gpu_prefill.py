"""DeepSeek-V4's prefill on an NVIDIA GPU in bf16 (the fused hyper-connection sites with the tiled
mix, the fused norm and rotation, the indexer's scores, the fused attention) against transformers
in float32: as close as the eager bf16 ops are. Skipped without a CUDA GPU (the CPU checks of each
kernel run in their own tests, through Triton's interpreter)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ds4desk.engine.kernels.deepseek_v4 import hc_fused as v4_hc_fused
from ds4desk.engine.kernels.deepseek_v4 import index_scores as v4_index_scores
from ds4desk.engine.kernels.deepseek_v4 import norm_rope as v4_norm_rope
from ds4desk.engine.kernels.launch import force
from ds4desk.engine.loader import load_model
from ds4desk.engine.models.deepseek_v4.model import DeepseekV4Model
from tests.engine.tiny_v4 import TINY_V4_CONFIG, save_tiny_v4

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def relative_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours - ref).norm() / ref.norm())


def bf16_prefill(model: DeepseekV4Model, ids: list[int], chunk: int, fused: bool) -> torch.Tensor:
    switches = (v4_hc_fused.SWITCH, v4_norm_rope.SWITCH, v4_index_scores.SWITCH)
    with force(dict.fromkeys(switches, None if fused else False)), torch.inference_mode():
        parts = [
            model.forward(torch.tensor(ids[s : s + chunk], device="cuda"), s, "all").cpu()
            for s in range(0, len(ids), chunk)
        ]
    return torch.cat(parts)


def test_fused_bf16_prefill_is_as_close_to_float32_transformers_as_the_eager_one(tmp_path: Path) -> None:
    hf, source = save_tiny_v4(tmp_path)
    ids = torch.randint(0, TINY_V4_CONFIG["vocab_size"], (200,), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        ref = hf(ids.unsqueeze(0)).logits[0].float()
    model = load_model(source, torch.device("cuda"), torch.bfloat16).model
    assert isinstance(model, DeepseekV4Model)
    model.allocate_cache(256)
    assert v4_hc_fused.enabled(torch.zeros(1, 4, 8, device="cuda"), 4) and v4_norm_rope.enabled(ids.cuda())
    eager = bf16_prefill(model, ids.tolist(), 64, fused=False)
    for chunk in (64, 200, 7):  # the tiled mix (64, 200 tokens) and the few-token kernels (7)
        fused = bf16_prefill(model, ids.tolist(), chunk, fused=True)
        # As test_deepseek_v4's CPU bf16 check: bf16 noise flips discrete picks on random weights.
        assert relative_error(fused[:10], ref[:10]) < 0.05
        assert relative_error(fused, ref) < 1.5 * relative_error(eager, ref) + 0.02, chunk
