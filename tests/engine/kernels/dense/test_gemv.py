"""The dense family's fused decode kernels (models/decode_kernels.py): each kernel equals its torch
form, and the graphable decode step built on them gives the logits of the unfused step for every
family switch (Llama's tied head and llama3 rope, Mistral's window, Qwen2's biases, Qwen3's per-head
norms). On CUDA the real kernels run; without a GPU, Triton's CPU interpreter runs the same source."""

from __future__ import annotations

import pytest
import torch

from ds4desk.engine.kernels.dense import gemv as kernels
from tests.engine.triton_check import run_triton_check


def test_the_cpu_keeps_the_torch_form() -> None:
    assert kernels.SWITCH.forced is None and not kernels.enabled(torch.device("cpu"))


def test_shapes_that_tiles_cannot_cover_are_refused() -> None:
    assert kernels.fits(torch.empty(64, 128))
    assert not kernels.fits(torch.empty(64, 100))  # K not a multiple of 64
    assert not kernels.fits(torch.empty(66, 128))  # N not a multiple of 4
    assert not kernels.fits(torch.empty(128, 64).t())  # rows not contiguous
    assert kernels.fits_heads(64) and kernels.fits_heads(128) and not kernels.fits_heads(80)


@pytest.mark.parametrize(("n", "k"), [(3072, 2048), (2048, 8192), (16384, 2048), (49152, 2048), (260, 192)])
def test_the_default_tiles_divide_the_shape(n: int, k: int) -> None:
    block_n, block_k, warps = kernels.gemv_config(n, k)
    assert n % block_n == 0 and k % block_k == 0 and warps in (1, 2, 4, 8)


_KERNEL_CHECK = """
import torch
from ds4desk.engine.kernels.dense import gemv as kd

device = "cuda" if torch.cuda.is_available() else "cpu"
gen = torch.Generator().manual_seed(0)
def rand(*shape, scale=1.0):
    return (scale * torch.randn(*shape, generator=gen)).to(device)

cases = 0
for dtype, tol in ((torch.float32, 2e-5), (torch.bfloat16, 3e-2)):
    for n, k, tiles in ((64, 128, None), (96, 192, (4, 64, 1)), (256, 512, (16, 128, 4))):
        kd.OVERRIDE = tiles
        x, norm = rand(1, k).to(dtype), (1 + 0.1 * rand(k)).to(dtype)
        w, bias = rand(n, k, scale=0.05).to(dtype), rand(n).to(dtype)
        for b in (None, bias):
            out = torch.empty(1, n, device=device, dtype=dtype)
            kd.norm_gemv(x, norm, w, b, 1e-5, out=out)
            fb = None if b is None else b.float()
            expected = kd.reference_norm_gemv(x.float(), norm.float(), w.float(), fb, 1e-5)
            torch.testing.assert_close(out.float(), expected, rtol=tol, atol=tol)
            cases += 1
        logits = torch.empty(1, n, device=device, dtype=torch.float32)  # the head: float32 out
        kd.norm_gemv(x, norm, w, None, 1e-5, out=logits)
        expected = kd.reference_norm_gemv(x.float(), norm.float(), w.float(), None, 1e-5)
        torch.testing.assert_close(logits, expected, rtol=tol, atol=tol)
        for silu, width in ((False, k), (True, 2 * k)):
            inp = rand(1, width).to(dtype)
            residual = rand(1, n).to(dtype)
            wanted = residual.float().clone()
            expected = kd.reference_gemv_add_(wanted, inp.float(), w.float(), bias.float(), silu)
            got = kd.gemv_add_(residual, inp, w, bias, silu)
            assert got is residual
            torch.testing.assert_close(residual.float(), expected, rtol=tol, atol=tol)
            cases += 1
kd.OVERRIDE = None

# Plain GEMV, and the picked experts' rows with a shared input / a clamped SwiGLU input a pick.
for dtype, tol in ((torch.float32, 2e-5), (torch.bfloat16, 3e-2)):
    x, w = rand(1, 128).to(dtype), rand(96, 128, scale=0.05).to(dtype)
    out = torch.empty(1, 96, device=device, dtype=dtype)
    kd.gemv(x, w, out)
    torch.testing.assert_close(out.float(), x.float() @ w.float().t(), rtol=tol, atol=tol)
    experts = rand(5, 16, 128, scale=0.05).to(dtype)
    ids = torch.tensor([3, 0, 3], device=device)
    out = torch.empty(3, 16, device=device, dtype=dtype)
    kd.experts_gemv(x, experts, ids, out)
    expected = kd.reference_experts_gemv(x.float(), experts.float(), ids, None)
    torch.testing.assert_close(out.float(), expected, rtol=tol, atol=tol)
    gate_up = rand(3, 256, scale=3.0).to(dtype)  # some beyond the limit
    kd.experts_gemv(gate_up, experts, ids, out, swiglu_limit=2.5)
    expected = kd.reference_experts_gemv(gate_up.float(), experts.float(), ids, 2.5)
    torch.testing.assert_close(out.float(), expected, rtol=tol, atol=tol)
    cases += 3

heads, kv, dim, context = 4, 2, 32, 20
angles = torch.outer(torch.arange(context).float(), torch.rand(dim // 2, generator=gen))
for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
    cos = torch.cat([angles.cos(), angles.cos()], 1).to(device, dtype)
    sin = torch.cat([-angles.sin(), angles.sin()], 1).to(device, dtype)
    for qk_norm in (None, (1 + 0.1 * rand(heads + kv, dim)).to(dtype)):
        for pos, tokens in ((0, 1), (7, 1), (context - 1, 1), (3, 5), (context - 6, 6)):
            qkv = rand(tokens, (heads + 2 * kv) * dim).to(dtype)
            cache = rand(2, kv, context, dim).to(dtype)
            at = torch.tensor([pos], device=device)
            want_qkv, want_cache = qkv.float().clone(), cache.float().clone()
            kd.reference_rope_write(want_qkv, cos.float(), sin.float(), at, want_cache, heads,
                                    None if qk_norm is None else qk_norm.float(), 1e-6)
            kd.rope_write(qkv, cos, sin, at, cache, heads, qk_norm, 1e-6)
            queries = heads * dim
            torch.testing.assert_close(qkv[:, :queries].float(), want_qkv[:, :queries], rtol=tol, atol=tol)
            torch.testing.assert_close(cache.float(), want_cache, rtol=tol, atol=tol)
            cases += 1
print("kernels ok", cases)
"""


def test_each_kernel_equals_its_torch_form() -> None:
    """Norm + GEMV (with and without bias, bf16 and float32 out), GEMV + residual (plain and SiLU·up
    input), RoPE + cache write (with and without per-head norms, first and last position, one token
    and several: a verify step's)."""
    assert "kernels ok 50" in run_triton_check(_KERNEL_CHECK)


_MODEL_CHECK = """
import tempfile
from pathlib import Path
import torch
from ds4desk.engine.kernels.dense import gemv as kd
from ds4desk.engine.kernels.dense import decode_attention as da
from ds4desk.engine.loader import load_model
from tests.engine.tiny_dense import save_tiny

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
da.SWITCH.forced = True
root = Path(tempfile.mkdtemp())
for family in ("llama", "mistral", "qwen2", "qwen3"):
    source = save_tiny(family, root / family)[1]
    model = load_model(source, device, torch.float32).model
    model.decode_attention = "triton"
    model.allocate_cache(64)
    prompt = torch.randint(0, 256, (9,), generator=torch.Generator().manual_seed(3)).to(device)
    token = torch.zeros(1, dtype=torch.long, device=device)
    at = torch.zeros(1, dtype=torch.long, device=device)
    with torch.inference_mode():
        model.forward(prompt, 0, "none")
        for pos in range(9, 24):  # past mistral's window of 8
            token.fill_(pos * 7 % 256)
            at.fill_(pos)
            before = model._cache.clone()
            with kd.SWITCH.force(False):
                expected = model.decode_graphable(token, at, 64)
            expected_cache = model._cache.clone()
            model._cache.copy_(before)
            with kd.SWITCH.force(True):
                assert model._kernels_fit(model._shards[0])
                got = model.decode_graphable(token, at, 64)
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(model._cache, expected_cache, rtol=1e-5, atol=1e-5)
    print(family, "ok")
"""


def test_the_step_on_the_kernels_equals_the_unfused_step() -> None:
    stdout = run_triton_check(_MODEL_CHECK)
    for family in ("llama", "mistral", "qwen2", "qwen3"):
        assert f"{family} ok" in stdout


_VERIFY_CHECK = """
import tempfile
from pathlib import Path
import torch
from ds4desk.engine.kernels.dense import gemv as kd
from ds4desk.engine.kernels.dense import decode_attention as da
from ds4desk.engine.loader import load_model
from tests.engine.tiny_dense import save_tiny

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
da.SWITCH.forced = True
calls = {"rope_write": 0}
def counted(*args, _real=kd.rope_write, **kwargs):
    calls["rope_write"] += 1
    return _real(*args, **kwargs)
kd.rope_write = counted
root = Path(tempfile.mkdtemp())
for family in ("llama", "mistral", "qwen3"):
    source = save_tiny(family, root / family)[1]
    model = load_model(source, device, torch.float32).model
    model.decode_attention = "triton"
    model.allocate_cache(64)
    prompt = torch.randint(0, 256, (9,), generator=torch.Generator().manual_seed(3)).to(device)
    layers = len(model._shards[0].plans)
    with torch.inference_mode():
        model.forward(prompt, 0, "none")
        for pos, count in ((9, 5), (12, 16)):  # past mistral's window of 8
            tokens = torch.randint(0, 256, (count,), generator=torch.Generator().manual_seed(pos)).to(device)
            at, last = torch.tensor([pos], device=device), torch.tensor([count], device=device)
            before = model._cache.clone()
            with kd.SWITCH.force(False):
                expected = model.verify_graphable(tokens, at, 48)
                expected_cache = model._cache.clone()
                model._cache.copy_(before)
                expected_piece = model.prefill_graphable(tokens, at, last, 48)
            model._cache.copy_(before)
            done = calls["rope_write"]
            with kd.SWITCH.force(True):
                got = model.verify_graphable(tokens, at, 48)
                torch.testing.assert_close(model._cache, expected_cache, rtol=1e-5, atol=1e-5)
                model._cache.copy_(before)
                got_piece = model.prefill_graphable(tokens, at, last, 48)
            assert calls["rope_write"] - done == 2 * layers
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(got_piece, expected_piece, rtol=1e-4, atol=1e-4)
            model._cache.copy_(before)
    print(family, "ok")
"""


def test_the_verify_step_on_the_rope_kernel_equals_the_torch_steps() -> None:
    """The graphable verify step and prompt piece with RoPE and the cache write of all T tokens
    in the decode step's kernel (Llama, Mistral's window, Qwen3's per-head norms; 5 and 16 tokens)
    give the logits and cache of the torch steps."""
    stdout = run_triton_check(_VERIFY_CHECK)
    for family in ("llama", "mistral", "qwen3"):
        assert f"{family} ok" in stdout


_V4_CHECK = """
import tempfile
from pathlib import Path
import torch
from ds4desk.engine.kernels.dense import gemv as kd
from ds4desk.engine.loader import load_model
from tests.engine.models.deepseek_v4.test_graphable import write_tiny

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
calls = {"gemv": 0, "experts_gemv": 0, "gemv_add_": 0}
for name in calls:
    def counted(*args, _real=getattr(kd, name), _name=name, **kwargs):
        calls[_name] += 1
        return _real(*args, **kwargs)
    setattr(kd, name, counted)
# Widths the tiles divide (make_tiny's 32-wide ranks do not), score- and hash-routed layers.
source = write_tiny(Path(tempfile.mkdtemp()), seed=4, moe_intermediate_size=64, q_lora_rank=64)
models = [load_model(source, device, torch.float32).model for _ in range(2)]
for model in models:
    model.allocate_cache(96)
prompt = torch.randint(0, 320, (21,), generator=torch.Generator().manual_seed(1)).to(device)
token = torch.zeros(1, dtype=torch.long, device=device)
at = torch.zeros(1, dtype=torch.long, device=device)
with torch.inference_mode():
    for model in models:
        model.forward(prompt, 0, "none")
    for pos in range(21, 29):  # across a CSA window boundary
        token.fill_(pos * 11 % 320)
        at.fill_(pos)
        with kd.SWITCH.force(False):
            expected = models[0].decode_graphable(token, at, 64)
        models[0].set_length(pos + 1)
        with kd.SWITCH.force(True):
            got = models[1].decode_graphable(token, at, 64)
        models[1].set_length(pos + 1)
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
# Per step and layer: 2 picked-expert GEMVs, the shared expert's down projection into the mix.
assert calls["experts_gemv"] == 8 * 2 * 4 and calls["gemv_add_"] == 8 * 4, calls
assert calls["gemv"] >= 8 * 4 * 4, calls
print("v4 ok", calls)
"""


def test_the_deepseek_v4_step_on_the_gemv_kernels_equals_cublas() -> None:
    """DeepSeek-V4's one-row linears, picked experts (by id on the device, clamped SwiGLU fused)
    and head on the GEMV kernels give the logits of the torch step."""
    assert "v4 ok" in run_triton_check(_V4_CHECK)


def test_the_fused_kernels_and_early_launch_stay_off_the_cpu() -> None:
    from ds4desk.engine.kernels import launch

    cpu = torch.zeros(1)
    assert not launch.nvidia(cpu) and not launch.nvidia(torch.device("cpu"))
    assert launch.PDL.forced is None and not launch.pdl(cpu)
    with launch.PDL.force(True):  # forced on: still never for a CPU tensor
        assert not launch.pdl(cpu)


_PACKED_MODEL_CHECK = """
import tempfile
from pathlib import Path
import torch
from ds4desk.engine.kernels.dense import gemv as kd
from ds4desk.engine.kernels.dense import decode_attention as da
from ds4desk.engine.kernels.quant import gguf_triton
from ds4desk.engine.kernels.quant import gguf_tiles
from ds4desk.engine.loader import fill, plan_load
from ds4desk.engine.loading.detect import read_source
from ds4desk.engine import loader
from tests.engine.tiny_dense import save_tiny

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
da.SWITCH.forced = True
root = Path(tempfile.mkdtemp())
wide = {"hidden_size": 256, "intermediate_size": 512, "vocab_size": 256}
as_q4 = loader.requantize_types


def mixed(source, weights):  # q4 with v in Q8_0: q/k/v groups of differing types, as in Q4_K_M
    types = as_q4(source, "q4")
    return {n: loader.Q8_0 if "v_proj" in n else t for n, t in types.items()}


for family, weights in [CASE]:
    save_tiny(family, root / family, **wide)
    loader.requantize_types = mixed if weights == "mixed" else as_q4
    quantize = weights.replace("mixed", "q4")
    plan = plan_load(read_source(root / family), device, torch.float32, 64, weights=quantize)
    model = fill(plan).model
    model.decode_attention = "triton"
    # Every height on the one-row kernel, so that the gate/up GEMV writes the down projection's
    # input and the attention o's (Q4_K: in read order), as on a real model's shapes; 16 rows a
    # program (Triton's interpreter runs a program's tile at once, and a program at a time).
    gguf_tiles.ONE_ROW_MIN_ROWS = dict.fromkeys(gguf_tiles.ONE_ROW_GROUPS, 0)
    gguf_tiles.ONE_ROW_OVERRIDE = (16, 16, 1)
    with gguf_triton.SWITCH.force(True):
        model.allocate_cache(64)
    plans = model._shards[0].plans
    assert (weights == "mixed") == any(p.qkv.parts for p in plans)
    assert all((p.down_input is not None) == (p.o_input is not None) == (weights != "q8") for p in plans)
    prompt = torch.randint(0, 256, (9,), generator=torch.Generator().manual_seed(3)).to(device)
    token = torch.zeros(1, dtype=torch.long, device=device)
    at = torch.zeros(1, dtype=torch.long, device=device)
    with torch.inference_mode():
        model.forward(prompt, 0, "none")
        for pos in range(9, 11):
            token.fill_(pos * 7 % 256)
            at.fill_(pos)
            before = model._cache.clone()
            with kd.SWITCH.force(False), gguf_triton.SWITCH.force(False):
                assert not model._kernels_fit(model._shards[0])
                expected = model.decode_graphable(token, at, 64)  # torch steps, reference matmuls
            expected_cache = model._cache.clone()
            model._cache.copy_(before)
            with kd.SWITCH.force(True), gguf_triton.SWITCH.force(True):
                assert model._kernels_fit(model._shards[0])
                got = model.decode_graphable(token, at, 64)  # fused kernels on the packed blocks
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(model._cache, expected_cache, rtol=1e-5, atol=1e-5)
    print(family, weights, "ok")
"""


@pytest.mark.parametrize(("family", "weights"), [("llama", "q4"), ("qwen2", "q8"), ("llama", "mixed")])
def test_the_step_on_packed_weights_runs_the_fused_gguf_kernels(family: str, weights: str) -> None:
    """GGUF-packed projections (here quantized on load; "mixed": q/k/v of differing types, as in a
    Q4_K_M file) take the same fused kernel path as bf16 ones, with the gate/up GEMV and the
    attention writing the next GEMV's input, and give the unfused step on the reference matmuls."""
    stdout = run_triton_check(_PACKED_MODEL_CHECK.replace("CASE", repr((family, weights))))
    assert f"{family} {weights} ok" in stdout
