"""DeepSeek-V4's fused decode compressor step (v4_compress_step): starting from a compressor state a
real prefill left, a run of single-token steps across several window boundaries leaves the same
state and entries through the Triton kernel (on CUDA, or Triton's CPU interpreter) as through the
eager reference, and both equal one prefill over all the tokens; and the model's graphable decode
with the fused op forced equals its eager steps."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from ds4desk.engine.kernels.deepseek_v4 import compress_step as v4_compress_step
from ds4desk.engine.loader import load_model
from ds4desk.engine.make_tiny import make_tiny
from ds4desk.engine.models.deepseek_v4.cache import CompressorState
from ds4desk.engine.models.deepseek_v4.config import CSA, HCA
from ds4desk.engine.models.deepseek_v4.model import DeepseekV4Model
from tests.engine.models.deepseek_v4.test_graphable import (
    Stepper,
    assert_same_state,
    relative_error,
    step_op_names,
    tokens,
    write_tiny,
)
from tests.engine.op_names import OpNames
from tests.engine.tiny_dense import source_from_folder
from tests.engine.triton_check import hopper_ptxas_report, run_triton_check

# The Triton checks below set the GPU where there is one (the real kernel takes no CPU tensors).
DEVICE = torch.device("cpu")
# make_tiny: CSA rate 4 (head_dim 32: 16 rotary dims; the indexer's 16 dims all rotate), HCA rate 8.
# Rate 32 (past one block of rows): the kernel's online softmax runs over several blocks.
CASES = {
    "csa": ({}, 1, "compressor", 40),
    "indexer": ({}, 1, "indexer", 40),
    "hca": ({}, 2, "compressor", 40),
    "hca_rate_128": ({"compress_rates": {CSA: 4, HCA: 128}}, 2, "compressor", 300),
    # Contexts ending inside a window: no entry row at all (6 < 8), and a last window without a row
    # (13 // 8 = 1: positions 8..12 never close theirs, and row 0, already written, must stay).
    "hca_no_rows": ({}, 2, "compressor", 6),
    "hca_clamped": ({}, 2, "compressor", 13),
}


def load_tiny(folder: Path, overrides: dict, dtype: torch.dtype, context: int) -> DeepseekV4Model:
    folder.mkdir(parents=True, exist_ok=True)
    if overrides:
        source = write_tiny(folder, seed=4, **overrides)
    else:
        make_tiny("deepseek_v4", folder, seed=4)
        source = source_from_folder(folder)
    model = load_model(source, DEVICE, dtype).model
    assert isinstance(model, DeepseekV4Model)
    model.allocate_cache(context)
    return model


@dataclass(slots=True)
class Compressor:
    """One compressor of a loaded tiny model, its state and rows, and the hidden inputs it is fed."""

    model: DeepseekV4Model
    module: torch.nn.Module
    state: CompressorState
    rows: torch.Tensor
    rate: int
    overlap: bool
    x: torch.Tensor  # [context, hidden]

    def prefill(self, stop: int) -> None:
        """The model's own chunked path (_compress) over positions 0..stop-1."""
        for start in range(0, stop, 7):  # chunks that end inside windows and across them
            end = min(stop, start + 7)
            self.model._compress(
                self.module, self.state, self.rows, self.x[start:end], start, self.rate, self.overlap
            )

    def step_args(self, state: CompressorState, rows: torch.Tensor, pos: int) -> tuple:
        x = self.x[pos : pos + 1]
        cos, sin = self.model._tables["compress"]
        return (
            x @ self.module.kv_proj.weight.t(),
            x @ self.module.gate_proj.weight.t(),
            self.module.position_bias,
            self.module.kv_norm.weight,
            state.kv,
            state.gate,
            state.prev_kv,
            state.prev_gate,
            rows,
            torch.tensor([pos], device=DEVICE),
            cos,
            sin,
            self.model.config.rms_norm_eps,
        )


def compressor(folder: Path, case: str, dtype: torch.dtype) -> Compressor:
    overrides, layer, which, context = CASES[case]
    model = load_tiny(folder, overrides, dtype, context)
    layer_type = model.config.layer_types[layer]
    comp = model.model.layers[layer].self_attn.compressor
    assert comp is not None
    cache = model.cache
    assert cache is not None
    layer_state = cache.layers[layer]
    if which == "indexer":
        module, state, rows = comp.indexer, layer_state.indexer, layer_state.index_entries
    else:
        module, state, rows = comp, layer_state.compressor, layer_state.entries
    assert state is not None and rows is not None
    gen = torch.Generator().manual_seed(len(case))
    x = torch.randn(context, model.config.hidden_size, generator=gen).to(DEVICE, dtype)
    rate = model.config.rate(layer_type)
    return Compressor(model, module, state, rows, rate, layer_type == CSA, x)


def copy_state(state: CompressorState) -> CompressorState:
    def clone(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.clone()

    kv, gate = state.kv.clone(), state.gate.clone()
    return CompressorState(kv, gate, clone(state.prev_kv), clone(state.prev_gate))


def compare(
    ours: CompressorState, ref: CompressorState, rows: torch.Tensor, ref_rows: torch.Tensor, tight: bool
) -> None:
    """The open window's rows, the overlap state and the entries (written rows and untouched ones)."""
    tol = {"rtol": 1e-5, "atol": 1e-5} if tight else {"rtol": 2e-2, "atol": 2e-2}
    for a, b in zip(ours.tensors(), ref.tensors(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)  # float32 state, the same inputs
    torch.testing.assert_close(rows.float(), ref_rows.float(), **tol)


def run_steps(comp: Compressor, start: int, stop: int, kernel) -> tuple[CompressorState, torch.Tensor]:
    """Steps start..stop-1 through `kernel` and the reference side by side, compared after each;
    returns the kernel's state and rows."""
    ours, ref = copy_state(comp.state), copy_state(comp.state)
    rows, ref_rows = comp.rows.clone(), comp.rows.clone()
    tight = comp.rows.dtype == torch.float32
    for pos in range(start, stop):
        kernel(*comp.step_args(ours, rows, pos))
        v4_compress_step.reference(*comp.step_args(ref, ref_rows, pos))
        compare(ours, ref, rows, ref_rows, tight)
    if stop >= comp.rate:
        assert rows[: stop // comp.rate].abs().sum() > 0  # entries were really written
    return ours, rows


def equals_one_prefill(comp: Compressor, ours: CompressorState, rows: torch.Tensor, stop: int) -> None:
    """The steps' entries and carry equal the model's prefill over every token at once."""
    old = comp.state
    parts = (old.kv, old.gate, old.prev_kv, old.prev_gate)
    fresh = CompressorState(*(None if t is None else torch.zeros_like(t) for t in parts))
    whole = torch.zeros_like(comp.rows)
    comp.model._compress(comp.module, fresh, whole, comp.x[:stop], 0, comp.rate, comp.overlap)
    tol = {"rtol": 1e-5, "atol": 1e-5} if rows.dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    closed = stop // comp.rate
    torch.testing.assert_close(rows[:closed].float(), whole[:closed].float(), **tol)
    left = stop % comp.rate  # rows of the open window
    torch.testing.assert_close(ours.kv[:left], fresh.kv[:left], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours.gate[:left], fresh.gate[:left], rtol=1e-5, atol=1e-5)
    if comp.overlap:
        assert ours.prev_kv is not None and fresh.prev_gate is not None
        torch.testing.assert_close(ours.prev_kv, fresh.prev_kv, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ours.prev_gate, fresh.prev_gate, rtol=1e-5, atol=1e-5)


def check_kernel(folder: Path, case: str, dtype: torch.dtype, prefill: int, steps: int) -> None:
    """The Triton kernel against the reference from a prefill's state, then against one prefill."""
    kernel = v4_compress_step._triton_kernel()
    assert kernel is not None
    comp = compressor(folder, case, dtype)
    comp.prefill(prefill)
    ours, rows = run_steps(comp, prefill, prefill + steps, kernel)
    equals_one_prefill(comp, ours, rows, prefill + steps)


def check_stop(folder: Path, case: str, dtype: torch.dtype, prefill: int, run) -> None:
    """`run` (the kernel or the reference) with a stop: at pos >= stop (a prompt piece's padding)
    nothing changes, windows that would close included; below it, the step without a stop."""
    comp = compressor(folder, case, dtype)
    comp.prefill(prefill)
    state, rows = copy_state(comp.state), comp.rows.clone()
    for pos in range(prefill, prefill + 2 * comp.rate + 1):
        before, rows_before = copy_state(state), rows.clone()
        for stop in (pos, pos - 1 if pos else pos):
            run(*comp.step_args(state, rows, pos), torch.tensor([stop], device=DEVICE))
            for a, b in zip(state.tensors(), before.tensors(), strict=True):
                assert torch.equal(a, b), (case, pos, stop)
            assert torch.equal(rows, rows_before), (case, pos, stop)
        plain, plain_rows = copy_state(state), rows.clone()
        v4_compress_step.reference(*comp.step_args(plain, plain_rows, pos))
        run(*comp.step_args(state, rows, pos), torch.tensor([pos + 1], device=DEVICE))
        compare(state, plain, rows, plain_rows, dtype == torch.float32)


def check_tokens(
    folder: Path, case: str, dtype: torch.dtype, prefill: int, count: int, stop: int | None, run
) -> None:
    """`run` fed `count` tokens in one call (their projections as the model makes them: row views
    of one product) equals the reference fed one token a call; with a stop, the tokens from it on
    change nothing."""
    comp = compressor(folder, case, dtype)
    comp.prefill(prefill)
    ours, ref = copy_state(comp.state), copy_state(comp.state)
    rows, ref_rows = comp.rows.clone(), comp.rows.clone()
    kv, gate = v4_compress_step.projections(comp.module, comp.x[prefill : prefill + count])
    _, _, *rest = comp.step_args(ours, rows, prefill)
    run(kv, gate, *rest, None if stop is None else torch.tensor([stop], device=DEVICE))
    for pos in range(prefill, prefill + count if stop is None else stop):
        v4_compress_step.reference(*comp.step_args(ref, ref_rows, pos))
    compare(ours, ref, rows, ref_rows, dtype == torch.float32)
    if prefill + count >= comp.rate:
        assert rows.abs().sum() > 0  # entries were really written


# --- the eager reference (no Triton needed) ---------------------------------------------------------


@pytest.mark.parametrize("case", ["csa", "indexer", "hca"])
def test_the_reference_leaves_the_state_alone_at_and_past_a_stop(tmp_path: Path, case: str) -> None:
    check_stop(tmp_path, case, torch.float32, 2, v4_compress_step.reference)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("prefill", [0, 1, 6])
def test_the_reference_steps_equal_one_prefill(tmp_path: Path, case: str, prefill: int) -> None:
    """From no prefill (window 0 has no predecessor), mid-window and at a window's last token."""
    comp = compressor(tmp_path, case, torch.float32)
    comp.prefill(prefill)
    stop = min(comp.x.shape[0], prefill + 3 * comp.rate + 2 if comp.rate < 100 else 2 * comp.rate + 5)
    ours, rows = run_steps(comp, prefill, stop, v4_compress_step.reference)
    equals_one_prefill(comp, ours, rows, stop)


@pytest.mark.parametrize(("case", "stop"), [("csa", None), ("indexer", 9), ("hca", None)])
def test_the_op_feeds_many_tokens_as_many_steps(tmp_path: Path, case: str, stop: int | None) -> None:
    with v4_compress_step.SWITCH.force(True):
        check_tokens(tmp_path, case, torch.float32, 3, 14, stop, v4_compress_step.compress_step)


def test_the_custom_op_is_one_op_with_the_reference_result(tmp_path: Path) -> None:
    comp = compressor(tmp_path, "csa", torch.float32)
    comp.prefill(5)
    ours, ref = copy_state(comp.state), copy_state(comp.state)
    rows, ref_rows = comp.rows.clone(), comp.rows.clone()
    for pos in range(5, 12):
        args = comp.step_args(ours, rows, pos)
        seen = OpNames()
        with torch.inference_mode(), seen:
            v4_compress_step.compress_step(*args)
        assert seen.names == ["v4_compress_step"], seen.names  # what a graph capture records
        v4_compress_step.reference(*comp.step_args(ref, ref_rows, pos))
        for a, b in zip(ours.tensors(), ref.tensors(), strict=True):
            assert torch.equal(a, b)
        assert torch.equal(rows, ref_rows)


# --- the Triton kernel ------------------------------------------------------------------------------

_KERNEL_CHECK = """
import sys
from pathlib import Path
import torch
from tests.engine.kernels.deepseek_v4 import test_compress_step as test_v4_compress_step
from tests.engine.kernels.deepseek_v4.test_compress_step import check_kernel, check_stop, check_tokens

if torch.cuda.is_available():
    test_v4_compress_step.DEVICE = torch.device("cuda")

folder = Path(sys.argv[1])
cases = [("csa", 6, 14), ("indexer", 0, 13), ("hca", 13, 19), ("hca_rate_128", 100, 170)]
for case, prefill, steps in cases + [("hca_no_rows", 1, 5), ("hca_clamped", 2, 11)]:
    for dtype in (torch.float32, torch.bfloat16):
        check_kernel(folder / f"{case}-{dtype}", case, dtype, prefill, steps)
kernel = test_v4_compress_step.v4_compress_step._triton_kernel()
for case, prefill in (("csa", 2), ("indexer", 0), ("hca", 5)):
    check_stop(folder / f"stop-{case}", case, torch.float32, prefill, kernel)
for case, prefill, count, stop in (("csa", 2, 13, None), ("indexer", 0, 16, 11), ("hca", 5, 16, None)):
    for dtype in (torch.float32, torch.bfloat16):
        check_tokens(folder / f"tokens-{case}-{dtype}", case, dtype, prefill, count, stop, kernel)
print("triton ok")
"""


def test_the_triton_kernel_equals_the_reference(tmp_path: Path) -> None:
    """On CUDA the real kernel; without a GPU, Triton's interpreter. CSA from a mid-window prefill,
    the indexer's compressor from nothing (window 0), HCA from mid-window, and rate 128 with several
    row blocks; float32 tight, bf16 loose; then steps with a stop. Skipped where Triton is not
    installed."""
    stdout = run_triton_check(_KERNEL_CHECK.replace("sys.argv[1]", repr(str(tmp_path))))
    assert "triton ok" in stdout


# --- the model's decode step ------------------------------------------------------------------------

CONTEXT = 48


def model_pair(folder: Path, dtype: torch.dtype) -> tuple[DeepseekV4Model, DeepseekV4Model]:
    folder.mkdir(parents=True, exist_ok=True)
    make_tiny("deepseek_v4", folder, seed=3)
    source = source_from_folder(folder)
    models = []
    for _ in range(2):
        model = load_model(source, DEVICE, dtype).model
        assert isinstance(model, DeepseekV4Model)
        model.allocate_cache(CONTEXT)
        models.append(model)
    return models[0], models[1]


def fused_steps_equal_eager_steps(folder: Path, dtype: torch.dtype, prefill: int, stop: int) -> None:
    """Graphable steps with the op forced on for one model, off for the other, from the same prefill."""
    fused, eager = model_pair(folder, dtype)
    source = source_from_folder(folder)
    ids = tokens(source, stop, seed=29)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    with torch.inference_mode():
        fused.forward(torch.tensor(ids[:prefill]), 0, "none")
        eager.forward(torch.tensor(ids[:prefill]), 0, "none")
        fused_stepper, eager_stepper = Stepper(fused), Stepper(eager)
        for pos in range(prefill, stop):
            with v4_compress_step.SWITCH.force(True):
                ours = fused_stepper.step(ids[pos], pos, CONTEXT)
            with v4_compress_step.SWITCH.force(False):
                ref = eager_stepper.step(ids[pos], pos, CONTEXT)
            assert relative_error(ours, ref) < tol, pos
    if dtype == torch.float32:
        assert_same_state(fused, eager, stop)
    else:
        a, b = fused.export_state(stop), eager.export_state(stop)
        for name in a:
            torch.testing.assert_close(a[name].float(), b[name].float(), rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_models_fused_steps_equal_its_eager_steps(tmp_path: Path, dtype: torch.dtype) -> None:
    """On the CPU the op's body is the reference (on CUDA the kernel): the wiring, arguments and
    state the model hands the op."""
    assert v4_compress_step.SWITCH.forced is None and not v4_compress_step.enabled(torch.zeros(1))
    fused_steps_equal_eager_steps(tmp_path, dtype, prefill=5, stop=CONTEXT)


def test_the_fused_step_runs_fewer_ops_the_same_at_every_position(tmp_path: Path) -> None:
    fused, eager = model_pair(tmp_path, torch.float32)
    source = source_from_folder(tmp_path)
    ids = tokens(source, 20, seed=31)
    recorded = step_op_names(fused, eager, v4_compress_step, ids, 3, 20, 32)
    fused_ops = recorded[(True, 3)]
    assert all(recorded[(True, pos)] == fused_ops for pos in range(3, 20))  # one graph fits all
    # make_tiny: CSA, HCA, CSA layers after a sliding one: 2 + 1 + 2 compressors a step.
    assert fused_ops.count("v4_compress_step") == 5
    assert "v4_compress_step" not in recorded[(False, 3)]
    # Each compressor's ~25 eager ops became its two projections and the op.
    assert len(recorded[(False, 3)]) - len(fused_ops) >= 5 * 15


_MODEL_CHECK = """
import sys
from pathlib import Path
import torch
from ds4desk.engine.kernels.deepseek_v4 import compress_step as v4_compress_step
from tests.engine.kernels.deepseek_v4 import test_compress_step as test_v4_compress_step
from tests.engine.kernels.deepseek_v4.test_compress_step import fused_steps_equal_eager_steps

if torch.cuda.is_available():
    test_v4_compress_step.DEVICE = torch.device("cuda")
else:
    v4_compress_step.SWITCH.kernel_on_cpu = True  # the interpreter runs the kernel on CPU tensors
folder = Path(sys.argv[1])
fused_steps_equal_eager_steps(folder / "f32", torch.float32, prefill=6, stop=22)
fused_steps_equal_eager_steps(folder / "bf16", torch.bfloat16, prefill=3, stop=14)
print("model ok")
"""


def test_the_models_steps_through_the_triton_kernel_equal_its_eager_steps(tmp_path: Path) -> None:
    stdout = run_triton_check(_MODEL_CHECK.replace("sys.argv[1]", repr(str(tmp_path))))
    assert "model ok" in stdout


# Flash's compressors (rope 64 dims: 32 pairs): CSA's (width 2 x 512), the indexer's (2 x 128), HCA's
# (rate 128), and a context shorter than one window (no entry rows).
FLASH_SHAPES = {
    "csa": (4, 1024, True, 2048, "bf16"),
    "indexer": (4, 256, True, 2048, "bf16"),
    "hca": (128, 512, False, 64, "bf16"),
    "hca_no_rows": (128, 512, False, 0, "fp32"),
}


@pytest.mark.parametrize("case", list(FLASH_SHAPES))
def test_the_kernel_compiles_for_hopper_at_flash_shapes(tmp_path: Path, case: str) -> None:
    """Ahead of time, no GPU needed: the interpreter runs any shape, a real compile also checks
    what only a GPU build does (types across the branches and loops, register-sized tiles)."""
    pytest.importorskip("triton")
    rate, width, overlap, rows, dtype = FLASH_SHAPES[case]
    kernel = v4_compress_step._jit_kernel()
    assert kernel is not None
    signature = {"kv_rows": f"*{dtype}", "gate_rows": f"*{dtype}", "kv_stride": "i32", "gate_stride": "i32"}
    pointers = {"bias": "fp32", "norm": "fp32", "state_kv": "fp32"}
    pointers |= {"state_gate": "fp32", "prev_kv": "fp32", "prev_gate": "fp32", "rows": dtype}
    pointers |= {"pos_ptr": "i64", "stop_ptr": "i64", "cos": "fp32", "sin": "fp32"}
    signature |= {name: "*" + kind for name, kind in pointers.items()}
    signature |= {"table_stride": "i32", "eps": "fp32", "count": "i32"}
    # A prompt piece's 16 tokens and stop on CSA's shapes (the loop and branch wrap the whole body).
    piece = case == "csa"
    constants = v4_compress_step.launch_constants(
        rate, width, overlap, rows, 32, stop=piece, tokens=16 if piece else 1
    )
    # Register-sized tiles: ptxas (bundled with Triton) reports no spills to local memory.
    report = hopper_ptxas_report(tmp_path, kernel, signature, constants, warps=4)
    assert "0 bytes spill stores" in report, report


def test_the_loader_fills_one_fused_projection_per_compressor(tmp_path: Path) -> None:
    """materialize makes kv_proj / gate_proj row halves of one tensor; the loader's copies land in
    it, so one product gives both projections, and the state dict is unchanged."""
    make_tiny("deepseek_v4", tmp_path, seed=6)
    source = source_from_folder(tmp_path)
    model = load_model(source, torch.device("cpu"), torch.float32).model
    assert isinstance(model, DeepseekV4Model)
    checkpoint = safe_open(str(tmp_path / "model.safetensors"), "pt")
    state = model.state_dict()
    assert not [name for name in state if "fused" in name]
    x = torch.randn(3, model.config.hidden_size, generator=torch.Generator().manual_seed(6))
    seen = 0
    for name, module in model.named_modules():
        if not hasattr(module, "position_bias"):
            continue
        both = module.fused_proj
        kv, gate = module.kv_proj.weight, module.gate_proj.weight
        assert kv.data_ptr() == both.data_ptr() and both.shape[0] == kv.shape[0] + gate.shape[0]
        for part in ("kv_proj", "gate_proj"):
            key = f"{name}.{part}.weight"
            assert torch.equal(state[key], checkpoint.get_tensor(key)), key
        assert torch.equal(
            both, torch.cat([checkpoint.get_tensor(f"{name}.{p}.weight") for p in ("kv_proj", "gate_proj")])
        )
        ours = v4_compress_step.projections(module, x)
        torch.testing.assert_close(ours[0], x @ kv.t(), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(ours[1], x @ gate.t(), rtol=1e-6, atol=1e-6)
        seen += 1
    assert seen == 5  # make_tiny: 2 CSA layers (compressor + indexer) and 1 HCA layer
    # A weight replaced after loading (no longer a view of the fused tensor) is never bypassed.
    comp = model.model.layers[2].self_attn.compressor
    assert comp is not None
    comp.gate_proj.weight = torch.nn.Parameter(comp.gate_proj.weight * 2, requires_grad=False)
    torch.testing.assert_close(v4_compress_step.projections(comp, x)[1], x @ comp.gate_proj.weight.t())
