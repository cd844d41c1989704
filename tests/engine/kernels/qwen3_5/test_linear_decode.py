"""Qwen3.5's fused linear-attention decode step (qwen35_linear_decode) and gated norm (qwen35_gated_norm):
the eager references are the model's own math op for op, each custom op is one op, the Triton kernels
(on CUDA, or Triton's CPU interpreter) equal the references at the published configs' head shapes and
small odd ones, and the model's decode and prefill through them equal its eager ones."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ds4desk.engine.kernels.qwen3_5 import gated_norm, linear_decode
from ds4desk.engine.loader import load_model
from ds4desk.engine.loading.detect import read_source
from ds4desk.engine.models.qwen3_5.model import Qwen35Model
from tests.engine.op_names import OpNames
from tests.engine.triton_check import hopper_ptxas_report, run_triton_check

# The Triton checks below set the GPU where there is one.
DEVICE = torch.device("cpu")
EPS = 1e-6
CONTEXT = 96

# (key heads, value heads, dk, dv, conv kernel): the linear layers of the published dense text configs
# (transformers' Qwen3_5TextConfig defaults are Qwen3.5-9B's: 16 key heads, 32 value heads, 128 wide;
# value heads equal to key heads as in the smallest ones) and small shapes no power of two wide.
SHAPES = {
    "9b": (16, 32, 128, 128, 4),
    "equal-heads": (16, 16, 128, 128, 4),
    "tiny": (2, 4, 8, 12, 4),
    "odd": (3, 9, 24, 20, 3),
}


def step_inputs(shape: str, dtype: torch.dtype, seed: int) -> dict[str, object]:
    """Random arguments of one decode step (a state that has run a while: not zeros)."""
    key_heads, heads, dk, dv, kernel = SHAPES[shape]
    channels = 2 * key_heads * dk + heads * dv
    gen = torch.Generator().manual_seed(seed)

    def randn(*size: int, scale: float = 1.0) -> torch.Tensor:
        return scale * torch.randn(size, generator=gen)

    return {
        "conv_inputs": randn(channels).to(dtype),
        "window": randn(channels, kernel - 1).to(dtype),
        "conv_weight": randn(channels, kernel, scale=0.4).to(dtype),
        "b": randn(heads).to(dtype),
        "a": randn(heads, scale=2.0).to(dtype),
        "neg_rate": -torch.rand(heads, generator=gen) * 3,
        "dt_bias": randn(heads),
        "state": randn(heads, dk, dv, scale=0.3),
        "z": randn(heads * dv).to(dtype),
        "norm_weight": (0.5 + torch.rand(dv, generator=gen)).to(dtype),
        "key_heads": key_heads,
        "eps": EPS,
    }


def moved(inputs: dict[str, object], device: torch.device) -> dict[str, object]:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}


def cloned(inputs: dict[str, object]) -> dict[str, object]:
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}


def relative_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours.float() - ref.float()).norm() / ref.float().norm())


# --- the references: the model's own eager math ---------------------------------------------------


def write_tiny_gguf(folder: Path) -> Path:
    """A tiny random Qwen3.5 in llama.cpp's layout (value heads tiled over the key heads)."""
    from tests.engine.models.qwen3_5.gguf_writer import make_hf, write_qwen35_gguf

    path = folder / "tiny.gguf"
    if not path.exists():
        folder.mkdir(parents=True, exist_ok=True)
        write_qwen35_gguf(path, make_hf(False, seed=2))
    return path


def write_tiny_folder(folder: Path, gemv_sized: bool = False) -> Path:
    """A tiny random Qwen3.5 Hugging Face folder (value heads grouped by key head). `gemv_sized`: every
    projection sized for the one-row GEMV kernels (input widths multiples of 64)."""
    from tests.engine.models.qwen3_5.tiny import save_tiny

    if not (folder / "config.json").exists():
        folder.mkdir(parents=True, exist_ok=True)
        sized = {"intermediate_size": 128, "linear_value_head_dim": 16} if gemv_sized else {}
        save_tiny(folder, seed=4, **sized)
    return folder


def load_tiny(path: Path, dtype: torch.dtype) -> Qwen35Model:
    model = load_model(read_source(path), DEVICE, dtype).model
    assert isinstance(model, Qwen35Model)
    model.allocate_cache(CONTEXT)
    return model


def tokens(count: int, seed: int) -> list[int]:
    return [int(t) for t in torch.randint(5, 300, (count,), generator=torch.Generator().manual_seed(seed))]


def steps_with_and_without(
    path: Path, dtype: torch.dtype, prefill: int, stop: int, chunk: int = 64, gemv: bool = False
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Logits of a prefill (in chunks of `chunk`) then graphable decode steps, with both ops forced
    on, then off (two models of the same file): (ours, eager, our state, eager state). `gemv`: the
    one-row GEMV kernels (kernels/dense/gemv.py) forced on and off with them (they have no CPU form:
    Triton's interpreter or a GPU only)."""
    from ds4desk.engine.kernels import launch
    from ds4desk.engine.kernels.dense import gemv as dense_gemv

    ids = tokens(stop, seed=9)
    results = []
    for flag in (True, False):
        model = load_tiny(path, dtype)
        switches = {linear_decode.SWITCH: flag, gated_norm.SWITCH: flag}
        if gemv:
            switches[dense_gemv.SWITCH] = flag
        with launch.force(switches), torch.inference_mode():
            logits = [
                model.forward(torch.tensor(ids[s : min(s + chunk, prefill)], device=DEVICE), s, "all")
                for s in range(0, prefill, chunk)
            ]
            for pos in range(prefill, stop):
                token = torch.tensor([ids[pos]], device=DEVICE)
                logits.append(
                    model.decode_graphable(token, torch.tensor([pos], device=DEVICE), CONTEXT)[None]
                )
                model.set_length(pos + 1)
        results.append((torch.cat(logits), model.export_state(stop)))
    (ours, our_state), (eager, eager_state) = results
    return ours, eager, our_state, eager_state


@pytest.mark.parametrize("layout", ["folder", "gguf"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_models_steps_through_the_ops_equal_its_eager_steps(tmp_path: Path, layout: str, dtype) -> None:
    """On the CPU the ops' bodies are the references: the model's prefill and decode through them equal
    its eager ones to the bit (the wiring, the arguments, the key-head order of both layouts)."""
    path = write_tiny_folder(tmp_path / "hf") if layout == "folder" else write_tiny_gguf(tmp_path)
    seen = OpNames()
    with seen:
        ours, eager, our_state, eager_state = steps_with_and_without(
            path, dtype, prefill=20, stop=30, chunk=7
        )
    # Per pass with the ops on: 3 prefill chunks and 10 steps, through 4 linear layers.
    assert seen.names.count("qwen35_gated_norm") == 3 * 4
    assert seen.names.count("qwen35_linear_decode") == 10 * 4
    assert torch.equal(ours, eager)
    for name, value in eager_state.items():
        assert torch.equal(our_state[name], value), name


def test_the_decode_op_is_one_op_with_the_reference_result() -> None:
    inputs = step_inputs("tiny", torch.float32, seed=1)
    expected_inputs = cloned(inputs)
    seen = OpNames()
    with torch.inference_mode(), seen:
        ours = linear_decode.linear_decode(**inputs, tiled=False)
    assert seen.names == ["qwen35_linear_decode"]  # what a graph capture or an op counter sees
    expected = linear_decode.reference(**expected_inputs, tiled=False)
    assert torch.equal(ours, expected)
    assert torch.equal(inputs["state"], expected_inputs["state"])
    assert torch.equal(inputs["window"], expected_inputs["window"])


def test_the_norm_op_is_one_op_with_the_reference_result() -> None:
    gen = torch.Generator().manual_seed(3)
    x, gate = torch.randn(5, 4, 12, generator=gen), torch.randn(5, 4, 12, generator=gen).to(torch.bfloat16)
    weight = torch.rand(12, generator=gen).to(torch.bfloat16)
    seen = OpNames()
    with torch.inference_mode(), seen:
        ours = gated_norm.gated_rms_norm(x, gate, weight, EPS)
    assert seen.names == ["qwen35_gated_norm"]
    assert torch.equal(ours, gated_norm.reference(x, gate, weight, EPS))


def test_the_cpu_takes_the_eager_path_by_default() -> None:
    assert linear_decode.SWITCH.forced is None and gated_norm.SWITCH.forced is None
    assert not linear_decode.enabled(torch.zeros(1)) and not gated_norm.enabled(torch.zeros(1))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"state": torch.zeros(4, 8, 12, dtype=torch.float64)}, "float32"),
        ({"key_heads": 3}, "multiple"),
        ({"conv_inputs": torch.zeros(10)}, "conv_inputs"),
        ({"window": torch.zeros(80, 2)}, "window"),
        ({"b": torch.zeros(3)}, "b must be"),
        ({"neg_rate": torch.zeros(4, dtype=torch.float16)}, "float32"),
        ({"z": torch.zeros(12)}, "z must be"),
    ],
)
def test_bad_arguments_get_a_clear_error(change: dict[str, object], message: str) -> None:
    inputs = {**step_inputs("tiny", torch.float32, seed=2), **change}
    with pytest.raises(ValueError, match=message):
        linear_decode.linear_decode(**inputs, tiled=False)


# --- the Triton kernels ---------------------------------------------------------------------------


def check_kernels(device: torch.device) -> None:
    """Both kernels against the references: several steps in a row (the window shifts, the state
    runs), both key-head orders, float32 (tight) and bf16 (the references round as often as the
    kernels, not always to the same value); the gated norm on prefill-shaped rows."""
    decode = linear_decode._triton_kernel()
    norm = gated_norm._triton_kernel()
    assert decode is not None and norm is not None
    for shape in SHAPES:
        for dtype in (torch.float32, torch.bfloat16):
            for tiled in (False, True):
                ours = moved(step_inputs(shape, dtype, seed=len(shape)), device)
                ref = cloned(ours)
                for step in range(3):
                    fresh = torch.randn(
                        ours["conv_inputs"].shape, generator=torch.Generator().manual_seed(step)
                    )
                    ours["conv_inputs"] = ref["conv_inputs"] = fresh.to(device, dtype)
                    got = decode(*ours.values(), tiled)  # in the signature's order
                    expected = linear_decode.reference(**ref, tiled=tiled)
                    assert got.dtype == dtype and got.shape == expected.shape
                    tol = 1e-5 if dtype == torch.float32 else 2e-2
                    where = (shape, dtype, tiled, step)
                    assert relative_error(got, expected) < tol, (where, relative_error(got, expected))
                    assert relative_error(ours["state"], ref["state"]) < tol, where
                    assert torch.equal(ours["window"], ref["window"]), where
    gen = torch.Generator().manual_seed(5)
    for rows, heads, width in ((37, 32, 128), (5, 4, 12), (1, 3, 20)):
        for x_dtype, dtype in ((torch.float32, torch.float32), (torch.float32, torch.bfloat16)):
            x = torch.randn(rows, heads, width, generator=gen).to(device, x_dtype)
            gate = torch.randn(rows, heads, width, generator=gen).to(device, dtype)
            weight = (0.5 + torch.rand(width, generator=gen)).to(device, dtype)
            got, expected = norm(x, gate, weight, EPS), gated_norm.reference(x, gate, weight, EPS)
            assert got.dtype == dtype and got.shape == gate.shape
            tol = 1e-5 if dtype == torch.float32 else 1e-2
            assert relative_error(got, expected) < tol, (rows, heads, width, dtype)


_KERNEL_CHECK = """
import torch
from tests.engine.kernels.qwen3_5.test_linear_decode import check_kernels

check_kernels(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
print("triton ok")
"""


def test_the_triton_kernels_equal_the_references() -> None:
    """On CUDA the real kernels; without a GPU, Triton's interpreter. Skipped without Triton."""
    assert "triton ok" in run_triton_check(_KERNEL_CHECK)


def _compile_for_hopper(
    tmp_path: Path, kernel, pointers: dict[str, str], scalars: dict[str, str], constants, warps
):
    """A real sm_90 compile of one launch, ahead of time (no GPU needed), then ptxas: no spills."""
    signature = {name: "*" + kind for name, kind in pointers.items()} | scalars
    report = hopper_ptxas_report(tmp_path, kernel, signature, dict(constants), warps)
    assert "0 bytes spill stores" in report, report


@pytest.mark.parametrize("tiled", [False, True])
def test_the_kernels_compile_for_hopper_at_9b_shapes(tmp_path: Path, tiled: bool) -> None:
    """The interpreter never compiles: the bf16 launches of a Qwen3.5-9B-shaped decode step and prefill
    norm, compiled for sm_90 as the GPU would, without register spills."""
    pytest.importorskip("triton")
    kernels = linear_decode._jit_kernels()
    assert kernels is not None
    conv_kernel, delta_kernel = kernels
    key_heads, heads, dk, dv, kernel = SHAPES["9b"]
    channels = 2 * key_heads * dk + heads * dv
    _compile_for_hopper(
        tmp_path,
        conv_kernel,
        {"x": "bf16", "window": "bf16", "weight": "bf16", "mixed": "bf16"},
        {"channels": "i32", "window_stride": "i32", "weight_stride": "i32"},
        linear_decode.conv_constants(channels, kernel),
        4,
    )
    pointers = {"mixed": "bf16", "b": "bf16", "a": "bf16", "neg_rate": "fp32", "dt_bias": "fp32"}
    pointers |= {"state": "fp32", "core": "fp32"}
    _compile_for_hopper(
        tmp_path,
        delta_kernel,
        pointers,
        {"q_scale": "fp32"},
        linear_decode.delta_constants(key_heads, heads, dk, dv, tiled),
        linear_decode.delta_warps(dk, dv),
    )
    norm_kernel = gated_norm._jit_kernel()
    for rows in (heads, 4096 * heads):  # a decode step's heads, a 4k prefill's rows
        _compile_for_hopper(
            tmp_path,
            norm_kernel,
            {"x": "fp32", "gate": "bf16", "weight": "bf16", "out": "bf16"},
            {"rows": "i32", "eps": "fp32"},
            gated_norm.launch_constants(rows, dv),
            4,
        )


_MODEL_CHECK = """
import sys
from pathlib import Path
import torch
from ds4desk.engine.kernels.qwen3_5 import gated_norm, linear_decode
from tests.engine.kernels.qwen3_5 import test_linear_decode as check

if torch.cuda.is_available():
    check.DEVICE = torch.device("cuda")
else:  # the interpreter runs the kernels on CPU tensors
    linear_decode.SWITCH.kernel_on_cpu = True
    gated_norm.SWITCH.kernel_on_cpu = True
folder = Path(sys.argv[1])
for path in (check.write_tiny_folder(folder / "hf"), check.write_tiny_gguf(folder)):
    ours, eager, our_state, eager_state = check.steps_with_and_without(path, torch.float32, 20, 30, chunk=7)
    assert check.relative_error(ours, eager) < 1e-4, check.relative_error(ours, eager)
    for name, value in eager_state.items():
        assert check.relative_error(our_state[name], value) < 1e-4, name
# The graphable step on the one-row GEMV kernels too (norms folded in, residual added in place).
from ds4desk.engine.models.qwen3_5 import linear_attention
calls = []
on_kernels = linear_attention.decode_on_kernels
def counted(*args):
    calls.append(1)
    return on_kernels(*args)
linear_attention.decode_on_kernels = counted
path = check.write_tiny_folder(folder / "gemv", gemv_sized=True)
ours, exact, our_state, eager_state = check.steps_with_and_without(path, torch.float32, 20, 26, 7, gemv=True)
assert check.relative_error(ours, exact) < 1e-4, check.relative_error(ours, exact)
for name, value in eager_state.items():
    assert check.relative_error(our_state[name], value) < 1e-4, name
# bf16: the kernels round where torch rounds, but not always to the same value (the interpreter even
# truncates), and a tiny random model amplifies that: the kernels' steps must be about as close to the
# float32 model's as the eager bf16 steps are.
ours, eager, _, _ = check.steps_with_and_without(path, torch.bfloat16, 20, 26, 7, gemv=True)
ours_error, eager_error = check.relative_error(ours, exact), check.relative_error(eager, exact)
print("bf16 errors against float32: kernels", ours_error, "eager", eager_error)
assert ours_error < 3 * eager_error + 2e-2, (ours_error, eager_error)
assert len(calls) == 2 * 6 * 4, len(calls)  # two dtypes, six steps, four linear layers
print("model ok")
"""


def test_the_models_steps_through_the_triton_kernels_equal_its_eager_steps(tmp_path: Path) -> None:
    stdout = run_triton_check(_MODEL_CHECK.replace("sys.argv[1]", repr(str(tmp_path))))
    assert "model ok" in stdout


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("layout", ["folder", "gguf"])
def test_captured_graphs_through_the_kernels_give_the_eager_tokens(tmp_path: Path, layout: str) -> None:
    """On a GPU: decode replayed from CUDA graphs that captured the kernels (and a prefill through the
    gated-norm kernel) against eager decode with both kernels off, and the next turn from a snapshot."""
    from ds4desk.engine.api import SamplingParams, SaveSnapshot
    from ds4desk.engine.runtime import Runtime
    from ds4desk.engine.snapshots import ModelIdentity, SnapshotStore

    path = write_tiny_folder(tmp_path / "hf") if layout == "folder" else write_tiny_gguf(tmp_path)
    device = torch.device("cuda")
    greedy = SamplingParams(temperature=0.0)
    prompt = tokens(150, seed=5)
    results = []
    for kernels in (True, False):
        with (
            linear_decode.SWITCH.force(None if kernels else False),
            gated_norm.SWITCH.force(None if kernels else False),
        ):
            assert linear_decode.enabled(device) == kernels
            model = load_model(read_source(path), device, torch.float32).model
            runtime = Runtime(model, device, context=512, chunk=64, graphs=kernels)
            store = SnapshotStore(ModelIdentity("q", "float32", 512))
            out = runtime.generate(
                prompt, greedy, 60, set(), lambda _t: None, lambda: False, None, store, True, SaveSnapshot()
            )
            follow = [*prompt, *out.tokens, 7, 8, 9]
            again = runtime.generate(follow, greedy, 20, set(), lambda _t: None, lambda: False, None, store)
            assert again.stats.reused_tokens == len(prompt) + len(out.tokens) - 1
            results.append((out.tokens, out.logprobs, again.tokens))
            runtime.close()
    (ours, our_logprobs, our_next), (eager, eager_logprobs, eager_next) = results
    assert ours == eager and our_next == eager_next
    assert max(abs(a - b) for a, b in zip(our_logprobs, eager_logprobs, strict=True)) < 1e-3
