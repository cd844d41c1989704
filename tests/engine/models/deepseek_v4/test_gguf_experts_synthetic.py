"""The random DeepSeek-V4 with routed experts in GGUF block types that bench/flash_one_gpu.py builds
(synthetic.build_gguf_experts, here at a small size on the CPU): its blocks are valid and spread as
the other weights, the model on them equals its twin on the dequantized experts (prefill and the
graphable decode step), and the benchmark script runs end to end. The GGUF that bench/flash_gguf.py
writes for the llama.cpp comparison is read by llama.cpp as ds4desk reads it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from ds4desk.engine.kernels.quant import gguf
from ds4desk.engine.loader import load_model
from ds4desk.engine.loading.detect import read_source
from ds4desk.engine.models.deepseek_v4.config import CSA, HASH_MOE, HCA, MOE, SLIDING
from ds4desk.engine.models.deepseek_v4.model import DeepseekV4Model
from ds4desk.engine.models.deepseek_v4.synthetic import build_gguf_experts, flash_config
from tests.engine.triton_check import run_triton_check

CPU = torch.device("cpu")
REPO = Path(__file__).resolve().parents[4]
TYPES = {"gate_proj": "Q2_K", "up_proj": "Q2_K", "down_proj": "Q3_K"}
SMALL = flash_config(
    vocab_size=512,
    hidden_size=256,
    num_hidden_layers=4,
    num_attention_heads=4,
    head_dim=64,
    partial_rotary_factor=0.5,
    q_lora_rank=64,
    o_groups=2,
    o_lora_rank=32,
    moe_intermediate_size=256,
    n_routed_experts=8,
    num_experts_per_tok=2,
    layer_types=[SLIDING, CSA, HCA, CSA],
    mlp_layer_types=[HASH_MOE, MOE, MOE, MOE],
    sliding_window=8,
    index_n_heads=4,
    index_head_dim=64,
    index_topk=4,
)


def _float_twin(model: DeepseekV4Model) -> DeepseekV4Model:
    """The same model with its routed experts dequantized to float32 (the GGUF layout kept)."""
    with torch.device("meta"):
        twin = DeepseekV4Model(model.config, torch.float32, quantized=True)
    twin.materialize(CPU)
    given = dict(model.named_parameters())
    with torch.inference_mode():
        for name, param in twin.named_parameters():
            value = given[name]
            if value.dtype == torch.uint8 and ".experts." in name:
                experts = model.get_submodule(name.rsplit(".", 1)[0])
                type_id = experts.type_ids[name.rsplit(".", 1)[1]]
                param.copy_(gguf.dequantize(value, type_id, param.shape))
            else:
                param.copy_(value)
    twin.finish_loading()
    return twin


def test_the_blocks_are_valid_and_spread_as_the_other_weights() -> None:
    model = build_gguf_experts(SMALL, CPU, TYPES, dtype=torch.float32)
    for layer in model.model.layers:
        experts = layer.mlp.experts
        for projection, name in TYPES.items():
            packed = getattr(experts, projection)
            assert packed.dtype == torch.uint8
            assert experts.type_ids[projection] == {"Q2_K": 10, "Q3_K": 11}[name]
            rows = packed.shape[1]
            cols = SMALL.hidden_size if projection != "down_proj" else SMALL.expert_size
            values = gguf.dequantize(packed, experts.type_ids[projection], (SMALL.num_experts, rows, cols))
            assert torch.isfinite(values).all()
            assert 0.015 < float(values.std()) < 0.025


def test_the_model_on_its_blocks_equals_its_twin_on_floats() -> None:
    model = build_gguf_experts(SMALL, CPU, TYPES, dtype=torch.float32)
    twin = _float_twin(model)
    ids = torch.randint(0, SMALL.vocab_size, (40,), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        outputs = []
        for one in (model, twin):
            one.allocate_cache(64)
            prefill = one.forward(ids[:36], 0, "all")
            steps = [
                one.decode_graphable(ids[i : i + 1], torch.tensor([i]), 64).clone() for i in range(36, 40)
            ]
            outputs.append((prefill, torch.cat(steps)))
    for ours, want in zip(outputs[0], outputs[1], strict=True):
        assert ours.shape == want.shape
        assert (ours - want).abs().max() <= 1e-4 * want.abs().max()


_BY_ID_CHECK = """
import torch
from ds4desk.engine.kernels.deepseek_v4 import route as v4_route
from ds4desk.engine.kernels.quant import gguf_triton as gt
from ds4desk.engine.kernels.quant import gguf_experts
from ds4desk.engine.kernels.quant import gguf_tiles
from ds4desk.engine.models.deepseek_v4.synthetic import build_gguf_experts
from tests.engine.models.deepseek_v4.test_gguf_experts_synthetic import SMALL, TYPES

calls = []
for op in ("experts_gemv", "experts_swiglu"):
    kernel = getattr(gguf_experts, op)
    setattr(gguf_experts, op, lambda *a, op=op, kernel=kernel, **kw: calls.append(op) or kernel(*a, **kw))
gguf_tiles.OVERRIDE = (32, 256, 4)  # 32 rows a program: few programs for the interpreter
device = "cuda" if torch.cuda.is_available() else "cpu"
model = build_gguf_experts(SMALL, torch.device(device), TYPES, dtype=torch.float32)
ids = torch.randint(0, SMALL.vocab_size, (12,), generator=torch.Generator().manual_seed(5)).to(device)
# The picked blocks gathered (the switch off); read in place by id on the general GEMV (three
# kernels a layer); on the low-bit experts kernel, gate and up as one kernel with the SwiGLU, its
# input laid out by the router's kernel.
RUNS = {"gathered": (False, None), "general": (True, None), "low_bit": (True, (64, 4, 1))}
if device == "cuda":
    del RUNS["general"]  # a GPU takes the low-bit kernel for Q2_K / Q3_K whatever the override
steps, counts = {}, {}
with torch.inference_mode():
    for run, (forced, setting) in RUNS.items():
        gguf_tiles.EXPERTS_OVERRIDE = setting
        calls.clear()
        with gt.SWITCH.force(forced), v4_route.SWITCH.force(forced or None):
            model.allocate_cache(32)
            model.forward(ids[:8], 0, "none")
            pos = torch.tensor([0], device=device)
            out = []
            for i in range(8, 12):
                pos.fill_(i)
                out.append(model.decode_graphable(ids[i : i + 1], pos, 32).clone())
            steps[run] = torch.cat(out)
        counts[run] = (calls.count("experts_gemv"), calls.count("experts_swiglu"))
want = steps["gathered"]
for run in RUNS:
    assert (steps[run] - want).abs().max() <= 1e-4 * want.abs().max(), (run, (steps[run] - want).abs().max())
# (the 8-token prefill + 4 steps) x 4 layers, each: nothing by id / gate, up, down / the pair, down
expected = {"gathered": (0, 0), "general": (60, 0), "low_bit": (20, 20)}
assert counts == {run: expected[run] for run in RUNS}, counts
print("by id ok")
"""


def test_the_decode_step_reads_the_picked_blocks_in_place() -> None:
    """The graphable decode step on the experts kernels (picked experts read by id: gate, up and down
    on the general GEMV, or the low-bit kernel's gate and up pair with its SwiGLU, then down) equals
    the step that gathers the picked blocks first: Triton's interpreter on the CPU."""
    assert "by id ok" in run_triton_check(_BY_ID_CHECK)


_PREFILL_CHECK = """
import torch
from ds4desk.engine.kernels.quant import gguf_triton as gt
from ds4desk.engine.kernels.quant import gguf_experts
from ds4desk.engine.kernels.quant import gguf_tiles
from ds4desk.engine.models.deepseek_v4 import moe
from ds4desk.engine.models.deepseek_v4.synthetic import build_gguf_experts
from tests.engine.models.deepseek_v4.test_gguf_experts_synthetic import SMALL, TYPES

chose, grouped = [], []
decide, run = moe._grouped_on_whole, moe._gguf_experts_grouped
moe._grouped_on_whole = lambda *args: chose.append(decide(*args)) or chose[-1]
moe._gguf_experts_grouped = lambda *args: grouped.append(1) or run(*args)
moe._DEQUANTIZE_VALUES = 3 * 256 * 256  # three experts a launch: the slices end mid-stack
moe.GROUPED_MIN_SHARE = 1 / 3  # of 8 experts: some of this model's chunks group, some loop
moe.BY_ID_MAX_PAIRS = 0  # the grouping first; the few-pairs path below
device = "cuda" if torch.cuda.is_available() else "cpu"
ids = torch.randint(0, SMALL.vocab_size, (64,), generator=torch.Generator().manual_seed(7)).to(device)
real, start = 5, 40  # the prompt piece's tokens and where it starts (below)


def run_prompts(model):  # the three prompts' logits: 64 tokens, 12 tokens, the piece's 5 after 40
    model.allocate_cache(64)
    full = model.forward(ids, 0, "all").float()
    model.allocate_cache(64)
    short = model.forward(ids[:12], 0, "all").float()
    model.allocate_cache(64)
    model.forward(ids[:start], 0, "none")
    return full, short, model.forward(ids[start : start + real], start, "last").float()


# The grouped GEMM takes bf16 on a GPU (float32 on the CPU). In float32 both paths agree to
# accumulation order. In bf16 they round in different places (a dequantized stack, an expert at a
# time), which this random model amplifies to tenths of a logit (5% of the logits' norm between
# its bf16 and float32 runs): there each path is held to the float32 model on the reference path,
# the kernels' no further from it than twice the reference's own distance.
dtype = torch.bfloat16 if device == "cuda" else torch.float32
exact = None
if dtype != torch.float32:
    with torch.inference_mode(), gt.SWITCH.force(False):
        exact = run_prompts(build_gguf_experts(SMALL, torch.device(device), TYPES, dtype=torch.float32))
    chose.clear()


def held(got, want, which, what):  # the kernels' logits against the reference path's, prompt `which`
    got, want = got.float(), want.float()
    if exact is None:
        error = (got - want).abs().max()
        assert error <= 1e-4 * want.abs().max(), (what, error)
        return
    truth = exact[which]

    def distance(logits):
        return float((logits - truth).norm() / truth.norm())

    assert distance(got) <= 2 * distance(want), (what, distance(got), distance(want))


model = build_gguf_experts(SMALL, torch.device(device), TYPES, dtype=dtype)
logits = {}
with torch.inference_mode():
    for forced in (False, True):  # an expert at a time on the reference / grouped where chosen
        with gt.SWITCH.force(forced):
            model.allocate_cache(64)
            logits[forced] = model.forward(ids, 0, "all")
held(logits[True], logits[False], 0, "grouped")
# The reference run never groups; the kernels' run groups the layers whose chunk reaches the share
# (the hash-routed first layer does) and loops over the others.
assert chose[:4] == [False] * 4 and True in chose[4:] and False in chose[4:], chose
assert len(grouped) == chose.count(True), (grouped, chose)

# A chunk of at most BY_ID_MAX_PAIRS (token, slot) pairs reads each pair's expert in place by id.
moe.BY_ID_MAX_PAIRS = 2 * 12
calls = []
for op in ("experts_gemv", "experts_swiglu"):
    kernel = getattr(gguf_experts, op)
    setattr(gguf_experts, op, lambda *a, kernel=kernel, **kw: calls.append(a[0].shape[0]) or kernel(*a, **kw))
# A layer's launches: gate, up, down (the CPU's general GEMV), or the gate and up pair and down (a GPU).
launches = 4 * (2 if device == "cuda" else 3)
gguf_tiles.OVERRIDE = (32, 256, 4)  # 32 rows a program: few programs for the interpreter
short = {}
with torch.inference_mode():
    for forced in (False, True):
        with gt.SWITCH.force(forced):
            model.allocate_cache(64)
            short[forced] = model.forward(ids[:12], 0, "all").float()
held(short[True], short[False], 1, "by id")
assert calls == [24] * launches, calls  # a row a pair

# A prompt piece (the graphable suffix of a follow-up turn) reads its rows' experts by id too, all
# rows at once; its padding rows change nothing.
from tests.engine.models.deepseek_v4.test_graphable import PIECE, smallest_bucket
padding = torch.randint(0, SMALL.vocab_size, (PIECE - real,), generator=torch.Generator().manual_seed(8))
with torch.inference_mode(), gt.SWITCH.force(False):
    model.allocate_cache(64)
    model.forward(ids[:start], 0, "none")
    last = model.forward(ids[start : start + real], start, "last").float()
    model.allocate_cache(64)
    model.forward(ids[:start], 0, "none")
    calls.clear()
    with gt.SWITCH.force(True):
        piece = model.prefill_graphable(
            torch.cat([ids[start : start + real], padding.to(device)]),
            torch.tensor([start], device=device),
            torch.tensor([real], device=device),
            smallest_bucket(start + PIECE - 1),
        )
held(piece, last, 2, "piece")
assert calls == [PIECE * 2] * launches, calls  # every row's 2 pairs, one launch for all
print("grouped ok")
"""


def test_a_prefill_chunk_runs_its_experts_as_grouped_gemms_on_dequantized_projections() -> None:
    """Where a prefill chunk reaches GROUPED_MIN_SHARE of the experts, each projection's stacked blocks are
    dequantized whole (in slices) for one grouped GEMM; a chunk of few (token, slot) pairs, and a
    prompt piece, read each pair's expert in place by id. The logits of each equal an expert at a
    time on the reference path: Triton's interpreter on the CPU."""
    assert "grouped ok" in run_triton_check(_PREFILL_CHECK)


def test_the_benchmark_runs_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "flash_one_gpu.json"
    command = [sys.executable, "bench/flash_one_gpu.py", "--tiny", "--device", "cpu"]
    command += ["--prompts", "24,40", "--new", "4", "--chunk", "16", "--out", str(out)]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["experts"] == TYPES and result["layers"] == 3
    assert [run["prompt"] for run in result["runs"]] == [24, 40]
    assert all(run["generated"] == 4 and run["decode_tok_s"] > 0 for run in result["runs"])
    assert result["decode_floor_tok_s"] > 0 and result["prefill_floor_tok_s"] > 0


def test_the_comparison_file_reads_in_llama_cpp_as_in_ds4desk(tmp_path: Path) -> None:
    """Teacher-forced top-1 agreement and the logits' correlation between llama.cpp (llama-cpp-python,
    CPU, 8-bit activations in its quantized matmuls) and ds4desk on the written file: a misread
    tensor (swapped, mis-scaled, mis-shaped) agrees at a few per cent."""
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not importable")
    sys.path.insert(0, str(REPO / "bench"))
    from flash_gguf import write
    from flash_one_gpu import geometry

    path = tmp_path / "flash-3-layers.gguf"
    write(path, geometry(3, tiny=True), TYPES)
    ids = torch.randint(2, 1000, (140,), generator=torch.Generator().manual_seed(1)).tolist()
    model = load_model(read_source(path), CPU, torch.float32).model
    with torch.inference_mode():
        model.allocate_cache(160)
        ours = model.forward(torch.tensor(ids), 0, "all").float().numpy()
    sizes = {"n_ctx": 160, "n_batch": 160, "n_ubatch": 160}
    llm = llama_cpp.Llama(model_path=str(path), logits_all=True, n_threads=2, verbose=False, **sizes)
    llm.eval(ids)
    theirs = np.array(llm.scores[: len(ids)])
    assert (ours.argmax(-1) == theirs.argmax(-1)).mean() >= 0.85
    assert np.corrcoef(ours.ravel(), theirs.ravel())[0, 1] >= 0.99
