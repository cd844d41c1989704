"""DeepSeek-V4's fused decode-step norm and rotation (v4_norm_rope): the eager reference is the model's own
ops.rms_norm / norm_rope / rope_ op for op, the custom op is one op, the Triton kernel (on CUDA, or
Triton's CPU interpreter) equals the reference for the four uses a decode step makes of it, and the
model's graphable decode with the op forced equals its eager steps."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

from ds4desk.engine.kernels.deepseek_v4 import norm_rope as v4_norm_rope
from ds4desk.engine.loader import load_model
from ds4desk.engine.make_tiny import make_tiny
from ds4desk.engine.models.deepseek_v4 import ops
from ds4desk.engine.models.deepseek_v4.model import DeepseekV4Model
from tests.engine.models.deepseek_v4.test_graphable import (
    Stepper,
    assert_same_state,
    relative_error,
    step_op_names,
    tokens,
)
from tests.engine.op_names import OpNames
from tests.engine.tiny_dense import source_from_folder
from tests.engine.triton_check import run_triton_check

# The Triton checks below set the GPU where there is one (the real kernel takes no CPU tensors).
DEVICE = torch.device("cpu")
EPS = 1e-6
POSITIONS = 40
PAIRS = 8  # a 16-dim rotation, as make_tiny's (head_dim 32, half of it rotary)

# The four uses of a decode step: name -> (rows, channels, weighted norm, norm, rope dims).
USES = {
    "q_res": (1, 48, True, True, 0),  # q_a_norm: norm with a weight, no rotation
    "q": (8, 32, False, True, 2 * PAIRS),  # every head: norm without weight, then rotate
    "kv": (1, 32, True, True, 2 * PAIRS),  # kv_norm: norm with a weight, then rotate
    "index": (16, 16, False, False, 2 * PAIRS),  # the indexer's query: rotate only, float32 out
}


def tables(pairs: int = PAIRS, positions: int = POSITIONS) -> tuple[torch.Tensor, torch.Tensor]:
    """cos / sin [positions, pairs] float32, as the model builds them (angles p * inv_i)."""
    inv = 10000.0 ** (-torch.arange(pairs, dtype=torch.float32) / pairs)
    angles = torch.outer(torch.arange(positions, dtype=torch.float32), inv)
    return angles.cos(), angles.sin()


def inputs(use: str, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor | None, float | None]:
    rows, channels, weighted, norm, _ = USES[use]
    gen = torch.Generator().manual_seed(seed)
    x = (3 * torch.randn(rows, channels, generator=gen)).to(dtype)
    weight = 0.5 + torch.rand(channels, generator=gen) if weighted else None
    return x, weight, EPS if norm else None


def out_dtype(use: str, dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if use == "index" else dtype


def todays_math(use: str, x: torch.Tensor, weight: torch.Tensor | None, pos: int) -> torch.Tensor:
    """What deepseek_v4's decode step computed for each use before the op."""
    cos, sin = tables()
    at = torch.tensor([pos])
    turn = ops.rotation(cos.index_select(0, at), sin.index_select(0, at))
    if use == "q_res":
        return ops.rms_norm(x, weight, EPS)
    if use == "index":
        return ops.rope_(x.clone().float(), turn)  # clone: in float32, .float() is x itself
    return ops.norm_rope(x, weight, EPS, turn)


@pytest.mark.parametrize("use", list(USES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_reference_is_todays_math_exactly(use: str, dtype: torch.dtype) -> None:
    cos, sin = tables()
    rope = USES[use][4]
    for pos in (0, 1, 17, POSITIONS - 1):
        x, weight, eps = inputs(use, dtype, seed=pos)
        before = x.clone()
        ours = v4_norm_rope.reference(
            x, weight, eps, cos, sin, torch.tensor([pos]), rope, out_dtype(use, dtype)
        )
        expected = todays_math(use, x, weight, pos)
        assert ours.dtype == expected.dtype == out_dtype(use, dtype)
        assert torch.equal(ours, expected), (use, pos)
        assert torch.equal(x, before)  # the input is never rotated in place
    if rope:  # the rotation really happened: position 0 (no turn) differs from position 17
        x, weight, eps = inputs(use, dtype, seed=0)
        at = (torch.tensor([0]), torch.tensor([17]))
        a, b = (v4_norm_rope.reference(x, weight, eps, cos, sin, p, rope, dtype) for p in at)
        assert torch.equal(a[:, :-rope], b[:, :-rope]) and not torch.equal(a[:, -rope:], b[:, -rope:])


def prefill_math(
    use: str, x: torch.Tensor, weight: torch.Tensor | None, start: int, group: int
) -> torch.Tensor:
    """What deepseek_v4's prefill computes: rows of `group` (heads) per position start, start + 1, ..."""
    cos, sin = tables()
    count = x.shape[0] // group
    turn = ops.rotation(cos[start : start + count], sin[start : start + count])
    shaped = x.view(count, group, -1)
    if use == "index":
        return ops.rope_(shaped.clone().float(), turn.unsqueeze(1)).view_as(x)
    return ops.norm_rope(shaped, weight, EPS, turn.unsqueeze(1)).view_as(x)


@pytest.mark.parametrize("use", ["q", "kv", "index"])
def test_row_groups_are_the_prefill_math_exactly(use: str) -> None:
    """group g: row r at position pos + r // g, as a prefill chunk's [T * H, d] query rows."""
    cos, sin = tables()
    group = USES[use][0]
    rows, channels = 5 * group, USES[use][1]
    gen = torch.Generator().manual_seed(4)
    x = (3 * torch.randn(rows, channels, generator=gen)).to(torch.bfloat16)
    weight = 0.5 + torch.rand(channels, generator=gen) if USES[use][2] else None
    eps = EPS if USES[use][3] else None
    ours = v4_norm_rope.reference(
        x, weight, eps, cos, sin, torch.tensor([11]), USES[use][4], out_dtype(use, x.dtype), group
    )
    assert torch.equal(ours, prefill_math(use, x, weight, 11, group))


@pytest.mark.parametrize("use", list(USES))
def test_the_custom_op_is_one_op_with_the_reference_result(use: str) -> None:
    cos, sin = tables()
    rope = USES[use][4]
    x, weight, eps = inputs(use, torch.bfloat16, seed=3)
    pos = torch.tensor([9])
    seen = OpNames()
    with torch.inference_mode(), seen:
        ours = v4_norm_rope.norm_rope(x, weight, eps, cos, sin, pos, rope, out_dtype(use, x.dtype))
    assert seen.names == ["v4_norm_rope"]  # what a graph capture or an op counter sees
    expected = v4_norm_rope.reference(x, weight, eps, cos, sin, pos, rope, out_dtype(use, x.dtype))
    assert torch.equal(ours, expected)


def test_the_cpu_takes_the_eager_path_by_default() -> None:
    assert v4_norm_rope.SWITCH.forced is None
    assert not v4_norm_rope.enabled(torch.zeros(1))


@pytest.mark.parametrize(
    ("shape", "weight", "eps", "rope", "pos", "message"),
    [
        ((32,), None, EPS, 16, [3], "rows"),
        ((2, 32), torch.ones(32), None, 16, [3], "weight needs eps"),
        ((2, 32), torch.ones(31), EPS, 16, [3], "weight needs eps"),
        ((2, 32), None, EPS, 8, [3], "rope_dims"),
        ((2, 8), None, EPS, 16, [3], "rope_dims"),
        ((2, 33), None, EPS, 16, [3], "rope_dims"),
        ((2, 32), None, EPS, 16, [3, 4], "pos"),
    ],
)
def test_bad_arguments_get_a_clear_error(shape, weight, eps, rope, pos, message) -> None:
    cos, sin = tables()
    with pytest.raises(ValueError, match=message):
        v4_norm_rope.norm_rope(
            torch.zeros(shape), weight, eps, cos, sin, torch.tensor(pos), rope, torch.float32
        )


# --- the Triton kernel ------------------------------------------------------------------------------


def check_kernel(device: torch.device) -> None:
    """The kernel against the reference for the four uses at several positions (float32 out: tight;
    bf16 out: one bf16 rounding apart), for Flash's widths, an odd width and a strided row view."""
    kernel = v4_norm_rope._triton_kernel()
    assert kernel is not None
    cos, sin = (t.to(device) for t in tables())
    for use, (_, _, _, _, rope) in USES.items():
        for dtype in (torch.float32, torch.bfloat16):
            for pos in (0, 5, POSITIONS - 1):
                x, weight, eps = inputs(use, dtype, seed=pos + 7)
                x = x.to(device)
                weight = None if weight is None else weight.to(device)
                at = torch.tensor([pos], device=device)
                to = out_dtype(use, dtype)
                ours = kernel(x, weight, eps, cos, sin, at, rope, to)
                ref = v4_norm_rope.reference(x, weight, eps, cos, sin, at, rope, to)
                assert ours.dtype == to and ours.shape == x.shape
                tol = 1e-5 if to == torch.float32 else 2e-2
                torch.testing.assert_close(ours.float(), ref.float(), rtol=tol, atol=tol)
    # Flash: q [64, 512], kv [1, 512], q_res [1, 1024] and the indexer's [64, 128], rope 64 dims.
    cos, sin = (t.to(device) for t in tables(32, 300))
    flash = [
        (64, 512, False, EPS, 64),
        (1, 512, True, EPS, 64),
        (1, 1024, True, EPS, 0),
        (64, 128, False, None, 64),
    ]
    gen = torch.Generator().manual_seed(1)
    for rows, channels, weighted, eps, rope in flash:
        x = torch.randn(rows, channels, generator=gen).to(device)
        weight = (0.5 + torch.rand(channels, generator=gen)).to(device) if weighted else None
        at = torch.tensor([299], device=device)
        ours = kernel(x, weight, eps, cos, sin, at, rope, torch.float32)
        ref = v4_norm_rope.reference(x, weight, eps, cos, sin, at, rope, torch.float32)
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    # A width that is no power of two (nor even: no rotation), from rows of a wider tensor.
    wide = torch.randn(3, 40, generator=gen).to(device)
    weight = torch.rand(33, generator=gen).to(device)
    at = torch.tensor([2], device=device)
    ours = kernel(wide[:, :33], weight, EPS, cos, sin, at, 0, torch.bfloat16)
    ref = v4_norm_rope.reference(wide[:, :33], weight, EPS, cos, sin, at, 0, torch.bfloat16)
    torch.testing.assert_close(ours.float(), ref.float(), rtol=2e-2, atol=2e-2)
    # A prefill's rows: 7 positions from 290 on, 64 query heads a position and one key row each.
    at = torch.tensor([290], device=device)
    for group, weighted in ((64, False), (1, True)):
        x = torch.randn(7 * group, 512, generator=gen).to(device)
        weight = (0.5 + torch.rand(512, generator=gen)).to(device) if weighted else None
        ours = kernel(x, weight, EPS, cos, sin, at, 64, torch.float32, group)
        ref = v4_norm_rope.reference(x, weight, EPS, cos, sin, at, 64, torch.float32, group)
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)


_KERNEL_CHECK = """
import torch
from tests.engine.kernels.deepseek_v4.test_norm_rope import check_kernel

check_kernel(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
print("triton ok")
"""


def test_the_triton_kernel_equals_the_reference() -> None:
    """On CUDA the real kernel; without a GPU, Triton's interpreter. Skipped where Triton is not
    installed."""
    assert "triton ok" in run_triton_check(_KERNEL_CHECK)


# Flash's four uses: (x dtype, out dtype, channels, rope pairs, norm, weighted).
FLASH_USES = {
    "q_res": ("bf16", "bf16", 1024, 0, True, True),
    "q": ("bf16", "bf16", 512, 32, True, False),
    "kv": ("bf16", "bf16", 512, 32, True, True),
    "index": ("bf16", "fp32", 128, 32, False, False),
}


@pytest.mark.parametrize("use", list(FLASH_USES))
def test_the_kernel_compiles_for_hopper_with_pdl_at_flash_shapes(tmp_path: Path, use: str) -> None:
    """Ahead of time, no GPU needed: a real sm_90 compile of the launch a decode step makes, the
    programmatic dependent launch branch included (the interpreter never takes it), without spills."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    x_type, out_type, channels, pairs, norm, weighted = FLASH_USES[use]
    kernel = v4_norm_rope._jit_kernel()
    assert kernel is not None
    pointers = {
        "x": x_type,
        "weight": "fp32",
        "cos": "fp32",
        "sin": "fp32",
        "pos_ptr": "i64",
        "out": out_type,
    }
    signature = {name: "*" + kind for name, kind in pointers.items()}
    signature |= {"stride_x": "i32", "table_stride": "i32", "group": "i32", "eps": "fp32"}
    constants = v4_norm_rope.launch_constants(channels, 2 * pairs, norm, weighted) | {"PDL": True}
    signature |= dict.fromkeys(constants, "constexpr")
    names = list(signature)
    source = ASTSource(
        fn=kernel, signature=signature, constexprs={(names.index(k),): v for k, v in constants.items()}
    )
    warps = v4_norm_rope._warps(channels)
    compiled = compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    ptx = compiled.asm["ptx"]
    assert compiled.asm["cubin"] and "griddepcontrol.wait" in ptx
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    ptx_file = tmp_path / "kernel.ptx"
    ptx_file.write_text(ptx)
    args = [str(ptxas), "-v", "--gpu-name", "sm_90a", str(ptx_file), "-o", str(tmp_path / "kernel.o")]
    report = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert report.returncode == 0, report.stderr
    assert "0 bytes spill stores" in report.stderr + report.stdout, report.stderr


# --- the model's decode step ------------------------------------------------------------------------

CONTEXT = 48


def load_tiny(folder: Path, dtype: torch.dtype) -> DeepseekV4Model:
    model = load_model(source_from_folder(folder), DEVICE, dtype).model
    assert isinstance(model, DeepseekV4Model)
    model.allocate_cache(CONTEXT)
    return model


def model_pair(folder: Path, dtype: torch.dtype) -> tuple[DeepseekV4Model, DeepseekV4Model]:
    folder.mkdir(parents=True, exist_ok=True)
    make_tiny("deepseek_v4", folder, seed=5)
    return load_tiny(folder, dtype), load_tiny(folder, dtype)


def fused_steps_equal_eager_steps(
    folder: Path, dtype: torch.dtype, prefill: int, stop: int, exact: bool
) -> None:
    """Graphable steps with the op forced on one model, off on the other, from the same prefill; `exact`:
    the op's body is the reference (the CPU), so the two must agree to the bit. In bf16 the kernel
    rounds its float32 result once as torch does, but not always to the same bf16 value, and a tiny
    random model amplifies that: there the fused steps must be as close to a float32 model's as the
    eager bf16 steps are."""
    fused, eager = model_pair(folder, dtype)
    anchor = load_tiny(folder, torch.float32) if dtype != torch.float32 else None
    ids = tokens(source_from_folder(folder), stop, seed=37)
    tol = 1e-5 if dtype == torch.float32 else 6e-2
    with torch.inference_mode():
        models = [fused, eager] if anchor is None else [fused, eager, anchor]
        for model in models:
            model.forward(torch.tensor(ids[:prefill], device=DEVICE), 0, "none")
        steppers = [Stepper(model) for model in models]
        for pos in range(prefill, stop):
            with v4_norm_rope.SWITCH.force(True):
                ours = steppers[0].step(ids[pos], pos, CONTEXT)
            with v4_norm_rope.SWITCH.force(False):
                ref = steppers[1].step(ids[pos], pos, CONTEXT)
                exact32 = steppers[2].step(ids[pos], pos, CONTEXT) if anchor is not None else None
            if exact:
                assert torch.equal(ours, ref), pos
            assert relative_error(ours, ref) < tol, (pos, relative_error(ours, ref))
            if exact32 is not None:
                bound = 1.5 * relative_error(ref, exact32) + 1e-2
                assert relative_error(ours, exact32) < bound, (pos, relative_error(ours, exact32), bound)
    if dtype == torch.float32:
        assert_same_state(fused, eager, stop)
    else:
        a, b = fused.export_state(stop), eager.export_state(stop)
        for name in a:  # bf16 noise, carried from step to step: ~2% at most here
            if b[name].abs().sum() > 0:
                assert relative_error(a[name].float(), b[name].float()) < 5e-2, name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_models_fused_steps_equal_its_eager_steps(tmp_path: Path, dtype: torch.dtype) -> None:
    """On the CPU the op's body is the reference: the wiring, arguments and dtypes the model hands it.
    From a prefill that closed CSA windows, past the ring's wrap (window 8) and more window closes."""
    fused_steps_equal_eager_steps(tmp_path, dtype, prefill=5, stop=30, exact=True)


def test_the_fused_step_has_one_op_a_use_the_same_at_every_position(tmp_path: Path) -> None:
    fused, eager = model_pair(tmp_path, torch.float32)
    ids = tokens(source_from_folder(tmp_path), 20, seed=41)
    recorded = step_op_names(fused, eager, v4_norm_rope, ids, 3, 20, 32)
    fused_ops = recorded[(True, 3)]
    assert all(recorded[(True, pos)] == fused_ops for pos in range(3, 20))  # one graph fits all
    # make_tiny: 4 layers (q_res, q, kv each) and 2 CSA layers (the indexer's query).
    assert fused_ops.count("v4_norm_rope") == 4 * 3 + 2
    assert "v4_norm_rope" not in recorded[(False, 3)]
    # Each use's casts, norm, table reads and complex product became the op.
    assert len(recorded[(False, 3)]) - len(fused_ops) >= 4 * 8


def prefill_with_and_without_the_op(folder: Path, dtype: torch.dtype, chunk: int) -> tuple[torch.Tensor, ...]:
    """All logits of a 30-token prompt in chunks of `chunk` with the op forced on, then off (the same
    model, restarted at 0), and the cache rows each left: (fused, eager, fused state, eager state)."""
    if not (folder / "config.json").exists():
        folder.mkdir(parents=True, exist_ok=True)
        make_tiny("deepseek_v4", folder, seed=5)
    model = load_tiny(folder, dtype)
    ids = torch.tensor(tokens(source_from_folder(folder), 30, seed=43), device=DEVICE)
    results = []
    for flag in (True, False):
        with v4_norm_rope.SWITCH.force(flag), torch.inference_mode():
            logits = [model.forward(ids[s : s + chunk], s, "all") for s in range(0, 30, chunk)]
        results.append((torch.cat(logits), model.export_state(30)))
    (fused, fused_state), (eager, eager_state) = results
    return fused, eager, fused_state, eager_state


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_models_fused_prefill_equals_its_eager_prefill(tmp_path: Path, dtype: torch.dtype) -> None:
    """On the CPU the op's body is the reference: a prefill through it (every query head, key row and
    indexer query of a chunk at its own position) equals the eager one to the bit."""
    seen = OpNames()
    with seen:
        fused, eager, fused_state, eager_state = prefill_with_and_without_the_op(tmp_path, dtype, 12)
    # Per chunk of the fused pass: q_res, q and kv in 4 layers; the indexer's query in 2 CSA layers
    # only in the chunk ending at 30 (7 entries at rate 4; before it no more than index_topk = 6).
    assert seen.names.count("v4_norm_rope") == 3 * 4 * 3 + 2
    assert torch.equal(fused, eager)
    for name, rows in eager_state.items():
        assert torch.equal(fused_state[name], rows), name


_MODEL_CHECK = """
import sys
from pathlib import Path
import torch
from ds4desk.engine.kernels.deepseek_v4 import norm_rope as v4_norm_rope
from tests.engine.kernels.deepseek_v4 import test_norm_rope as test_v4_norm_rope
from tests.engine.kernels.deepseek_v4.test_norm_rope import fused_steps_equal_eager_steps

if torch.cuda.is_available():
    test_v4_norm_rope.DEVICE = torch.device("cuda")
else:
    v4_norm_rope.SWITCH.kernel_on_cpu = True  # the interpreter runs the kernel on CPU tensors
folder = Path(sys.argv[1])
fused_steps_equal_eager_steps(folder / "f32", torch.float32, prefill=6, stop=18, exact=False)
fused_steps_equal_eager_steps(folder / "bf16", torch.bfloat16, prefill=3, stop=12, exact=False)
fused, eager, _, _ = test_v4_norm_rope.prefill_with_and_without_the_op(folder / "f32", torch.float32, 12)
torch.testing.assert_close(fused, eager, rtol=1e-4, atol=1e-4)
print("model ok")
"""


def test_the_models_steps_through_the_triton_kernel_equal_its_eager_steps(tmp_path: Path) -> None:
    stdout = run_triton_check(_MODEL_CHECK.replace("sys.argv[1]", repr(str(tmp_path))))
    assert "model ok" in stdout
