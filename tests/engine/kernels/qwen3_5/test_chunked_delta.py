"""Qwen3.5's chunked gated delta rule as one op (qwen35_chunked_delta): the op is one op whose CPU body
is the reference, the Triton kernels (on CUDA, or Triton's CPU interpreter) equal the reference at
Qwen3.5-9B's head shapes and small odd ones, over runs shorter than, equal to and longer than a chunk,
from a carried state and with the model's strided inputs, with queries and keys per key head in both
orders; the model's prefill through the kernels
equals its eager prefill; and the kernels compile for Hopper without spills."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ds4desk.engine.kernels.qwen3_5 import chunked_delta
from tests.engine.models.qwen3_5.test_delta_rule import inputs as head_first_inputs
from tests.engine.op_names import OpNames
from tests.engine.triton_check import hopper_ptxas_report, run_triton_check


def inputs(
    length: int, heads: int, dk: int, dv: int, seed: int, decay: float = 1.0
) -> tuple[torch.Tensor, ...]:
    """test_delta_rule's random arguments laid out as the model passes them: [T, H, d] tensors seen
    heads first (transposed views, not contiguous), a carried state."""
    *per_token, state = head_first_inputs(length, heads, dk, dv, seed, decay)
    return (*(t.transpose(0, 1).contiguous().transpose(0, 1) for t in per_token), state)


def relative_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours - ref).norm() / ref.norm())


def test_the_op_is_one_op_with_the_reference_result() -> None:
    q, k, v, g, beta, state = inputs(70, heads=3, dk=8, dv=6, seed=1)
    carried, expected_state = state.clone(), state.clone()
    seen = OpNames()
    with torch.inference_mode(), seen, chunked_delta.SWITCH.force(True):
        ours = chunked_delta.chunked(q, k, v, g, beta, carried)
    assert seen.names == ["qwen35_chunked_delta"]  # what a graph capture or an op counter sees
    expected = chunked_delta.reference(q, k, v, g, beta, expected_state)
    assert torch.equal(ours, expected) and torch.equal(carried, expected_state)


def repeated(x: torch.Tensor, heads: int, interleaved: bool) -> torch.Tensor:
    """Per-key-head [KH, T, d] spelled out per value head: h reads h // repeat or h % KH."""
    repeat = heads // x.shape[0]
    return x.repeat_interleave(repeat, dim=0) if interleaved else x.repeat(repeat, 1, 1)


def key_head_inputs(
    length: int, heads: int, key_heads: int, dk: int, dv: int, seed: int
) -> tuple[torch.Tensor, ...]:
    """`inputs` whose q and k hold only `key_heads` heads (the first ones drawn)."""
    q, k, v, g, beta, state = inputs(length, heads, dk, dv, seed)
    return q[:key_heads], k[:key_heads], v, g, beta, state


@pytest.mark.parametrize("interleaved", [True, False])
def test_queries_and_keys_per_key_head_equal_them_repeated_to_the_value_heads(interleaved: bool) -> None:
    """Fewer q/k heads than value heads: value head h reads key head h // repeat (Hugging Face's order)
    or h % key heads (a GGUF's), the same result as the repeated tensors, and different orders differ."""
    q, k, v, g, beta, state = key_head_inputs(70, heads=6, key_heads=2, dk=8, dv=6, seed=4)
    ours, expected_state = state.clone(), state.clone()
    got = chunked_delta.chunked(q, k, v, g, beta, ours, interleaved=interleaved)
    full = (repeated(q, 6, interleaved), repeated(k, 6, interleaved))
    expected = chunked_delta.reference(*full, v, g, beta, expected_state)
    assert torch.equal(got, expected) and torch.equal(ours, expected_state)
    other = chunked_delta.reference(q, k, v, g, beta, state.clone(), interleaved=not interleaved)
    assert relative_error(other, expected) > 0.1
    with pytest.raises(ValueError, match="q"):
        chunked_delta.chunked(q[:1].expand(4, -1, -1), k[:1].expand(4, -1, -1), v, g, beta, state)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"state": torch.zeros(3, 8, 6, dtype=torch.float64)}, "float64"),
        ({"state": torch.zeros(3, 8, 7)}, "state"),
        ({"beta": torch.zeros(3, 4)}, "beta"),
        ({"q": torch.zeros(3, 5, 9)}, "q"),
    ],
)
def test_bad_arguments_get_a_clear_error(change: dict[str, torch.Tensor], message: str) -> None:
    names = ("q", "k", "v", "g", "beta", "state")
    arguments = {**dict(zip(names, inputs(5, heads=3, dk=8, dv=6, seed=2), strict=True)), **change}
    with pytest.raises(ValueError, match=message):
        chunked_delta.chunked(**arguments)


# --- the Triton kernels ---------------------------------------------------------------------------

# (length, heads, dk, dv, decay): one token, runs shorter than the smallest chunk and than a whole
# one (chunks of 16 and 32 tokens: one and two blocks of the inverse), one exact chunk, several
# chunks with a ragged end, strong decays (a chunk's factors underflow), Qwen3.5-9B's 128-wide
# heads over three chunks, and widths no power of two.
CASES = [
    (1, 3, 8, 6, 1.0),
    (5, 3, 8, 6, 1.0),
    (20, 2, 8, 6, 1.0),
    (64, 2, 24, 20, 1.0),
    (100, 3, 8, 6, 1.0),
    (150, 2, 16, 16, 2.0),
    (130, 2, 128, 128, 1.0),
    (40, 1, 256, 96, 1.0),
]

# (length, value heads, key heads, dk, dv, interleaved): q and k per key head, in both orders.
KEY_HEAD_CASES = [
    (100, 4, 2, 8, 6, True),
    (100, 4, 2, 8, 6, False),
    (130, 4, 2, 128, 128, True),
    (70, 6, 3, 16, 8, False),
]


def check_kernels(device: torch.device) -> None:
    """The kernels against the reference: outputs and the carried state; IEEE float32 products tight,
    TF32 ones (a 16-bit model's; on a GPU only: the interpreter multiplies in float32) within what
    TF32's 10-bit mantissa allows, far inside a bf16 model's own rounding."""
    kernel = chunked_delta._triton_kernel()
    assert kernel is not None
    for tf32, tol in ((False, 1e-5), (True, 5e-3)) if device.type == "cuda" else ((False, 1e-5),):
        for length, heads, dk, dv, decay in CASES:
            arguments = inputs(length, heads, dk, dv, seed=length, decay=decay)
            q, k, v, g, beta, state = (t.to(device) for t in arguments)
            ours, expected_state = state.clone(), state.clone()
            got = kernel(q, k, v, g, beta, ours, tf32, True)
            expected = chunked_delta.reference(q, k, v, g, beta, expected_state)
            where = (length, heads, dk, dv, decay, tf32)
            assert got.shape == expected.shape and torch.isfinite(got).all(), where
            assert relative_error(got, expected) < tol, (where, relative_error(got, expected))
            assert relative_error(ours, expected_state) < tol, (where, relative_error(ours, expected_state))
        for length, heads, key_heads, dk, dv, interleaved in KEY_HEAD_CASES:
            arguments = key_head_inputs(length, heads, key_heads, dk, dv, seed=length)
            q, k, v, g, beta, state = (t.to(device) for t in arguments)
            ours, expected_state = state.clone(), state.clone()
            got = kernel(q, k, v, g, beta, ours, tf32, interleaved)
            full = (repeated(q, heads, interleaved), repeated(k, heads, interleaved))
            expected = chunked_delta.reference(*full, v, g, beta, expected_state)
            where = (length, heads, key_heads, dk, dv, interleaved, tf32)
            assert relative_error(got, expected) < tol, (where, relative_error(got, expected))
            assert relative_error(ours, expected_state) < tol, (where, relative_error(ours, expected_state))


def check_model(folder: str) -> None:
    """The tiny Qwen3.5's prefill in chunks of 7 and 82 tokens (each continues the state of the one
    before; 82 are two of the kernels' chunks), float32, with the kernels forced on, against the same
    model on the reference."""
    from ds4desk.engine.loader import load_model
    from ds4desk.engine.loading.detect import read_source
    from tests.engine.kernels.qwen3_5.test_linear_decode import CONTEXT, tokens

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    chunked_delta.SWITCH.kernel_on_cpu = True
    ids = torch.tensor(tokens(89, seed=11), device=device)
    results = []
    for flag in (True, False):
        model = load_model(read_source(Path(folder)), device, torch.float32).model
        model.allocate_cache(CONTEXT)
        with chunked_delta.SWITCH.force(flag), torch.inference_mode():
            logits = [model.forward(ids[s : s + n], s, "all") for s, n in ((0, 7), (7, 82))]
        results.append(torch.cat(logits))
    ours, eager = results
    assert relative_error(ours, eager) < 1e-5, relative_error(ours, eager)


_KERNEL_CHECK = """
import torch
from tests.engine.kernels.qwen3_5.test_chunked_delta import check_kernels

check_kernels(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
print("triton ok")
"""


def test_the_triton_kernels_equal_the_reference() -> None:
    """On CUDA the real kernels; without a GPU, Triton's interpreter. Skipped without Triton."""
    assert "triton ok" in run_triton_check(_KERNEL_CHECK)


def test_the_models_prefill_through_the_kernels_equals_its_eager_prefill(tmp_path: Path) -> None:
    from tests.engine.kernels.qwen3_5.test_linear_decode import write_tiny_folder

    folder = write_tiny_folder(tmp_path / "hf")
    script = "from tests.engine.kernels.qwen3_5.test_chunked_delta import check_model\n"
    script += f"check_model({str(folder)!r})\nprint('model ok')\n"
    assert "model ok" in run_triton_check(script)


_LENGTHS_CHECK = """
import torch
from triton import knobs
from ds4desk.engine.kernels.qwen3_5 import chunked_delta
from tests.engine.kernels.qwen3_5.test_chunked_delta import inputs

compiled = []


def hook(*, repr, **_):
    compiled.append(repr)
    return False


knobs.runtime.jit_cache_hook = hook
for length in (250, 1000, 1024, 2024, 3000, 4096):
    q, k, v, g, beta, state = (t.cuda() for t in inputs(length, heads=4, dk=128, dv=128, seed=length))
    chunked_delta.chunked(q, k, v, g, beta, state, tf32=True)
    torch.cuda.synchronize()
    print(length, len(compiled), flush=True)
    if length == 250:
        assert len(compiled) == 3, compiled  # the first run meets the three kernels
        compiled.clear()
assert compiled == [], compiled
print("lengths ok")
"""


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: the interpreter compiles nothing")
def test_a_run_of_any_length_reuses_the_compiled_kernels() -> None:
    """The token and chunk counts are not specialised: once a fresh process has run 250 tokens, runs
    of other classes of Triton's integer specialisation (a multiple of 16 tokens, 16 or 32 chunks)
    compile nothing (a first request of 1,000 tokens paid a 636 ms compile)."""
    assert "lengths ok" in run_triton_check(_LENGTHS_CHECK)


# --- ahead of time: the kernels as an H200 runs them ----------------------------------------------


@pytest.mark.parametrize("dk,dv", [(128, 128), (256, 256)])
@pytest.mark.parametrize("precision", ["tf32", "ieee"])
def test_the_kernels_compile_for_hopper(tmp_path: Path, dk: int, dv: int, precision: str) -> None:
    """Qwen3.5-9B's heads (128 wide) and twice that, at a full chunk. A 16-bit model's products (TF32
    inputs) do not spill registers at 128; the float32 model's (IEEE, on the FMA units) compile."""
    pytest.importorskip("triton")
    from ds4desk.engine.kernels.qwen3_5 import chunked_delta_triton

    length = 4096
    precision = {"PRECISION": precision, "KEY_HEADS": 16, "KEY_DIV": 2}  # 32 value heads read 16 key heads
    pointers = {"k": "*fp32", "gam": "*fp32"}
    prepare = {"k": "*fp32", "v": "*fp32", "g": "*fp32", "beta": "*fp32", "gam": "*fp32"}
    prepare |= {"w": "*fp32", "u": "*fp32", "lower_buf": "*fp32", "inverse_buf": "*fp32", "length": "i32"}
    prepare |= dict.fromkeys(("stride_kh", "stride_kt", "stride_vh", "stride_vt"), "i32")
    prepare |= dict.fromkeys(("stride_gh", "stride_gt", "stride_bh", "stride_bt", "padded"), "i32")
    state = pointers | {"w": "*fp32", "u": "*fp32", "starts": "*fp32", "state": "*fp32"}
    state |= dict.fromkeys(("length", "chunks", "stride_kh", "stride_kt", "padded"), "i32")
    output = {"q": "*fp32"} | pointers | {"u": "*fp32", "starts": "*fp32", "out": "*fp32"}
    output |= dict.fromkeys(("length", "chunks", "stride_qh", "stride_qt", "stride_kh", "stride_kt"), "i32")
    output |= dict.fromkeys(("stride_oh", "stride_ot", "padded"), "i32")
    constants = chunked_delta.launch_constants(dk, dv, length) | precision
    along = chunked_delta.state_constants(dk, dv, length) | precision
    for name, signature, values in (
        ("prepare_kernel", prepare, constants),
        ("state_kernel", state, along),
        ("output_kernel", output, constants),
    ):
        kernel = getattr(chunked_delta_triton, name)
        report = hopper_ptxas_report(tmp_path, kernel, signature, values, chunked_delta.WARPS, stages=1)
        if precision["PRECISION"] == "tf32" and dk == 128:
            assert "0 bytes spill stores" in report, (name, report)
