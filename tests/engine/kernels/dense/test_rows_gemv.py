"""The few-row GEMVs of the verify step and prompt piece (kernels/dense/rows_gemv.py): each equals
its torch form for every row count up to 16, and the dense family's graphable verify and prompt
piece on them give the logits and cache of the torch verify path. On CUDA the real kernels run;
without a GPU, Triton's interpreter runs the same source."""

from __future__ import annotations

import torch

from ds4desk.engine.kernels.dense import rows_gemv
from tests.engine.triton_check import run_triton_check


def test_weights_the_tiles_cannot_cover_are_refused() -> None:
    assert rows_gemv.fits(torch.empty(64, 128))
    assert not rows_gemv.fits(torch.empty(66, 128))  # N not a multiple of 4
    assert not rows_gemv.fits(torch.empty(64, 96))  # K not a multiple of 64
    assert not rows_gemv.fits(torch.empty(128, 64).t())  # rows not contiguous
    x = torch.zeros(3, 128)
    assert not rows_gemv.runs(x, torch.empty(64, 128))  # the CPU keeps the torch path


_KERNEL_CHECK = """
import torch
from ds4desk.engine.kernels.dense import gemv as kd
from ds4desk.engine.kernels.dense import rows_gemv as rg

device = "cuda" if torch.cuda.is_available() else "cpu"
gen = torch.Generator().manual_seed(0)
def rand(*shape, scale=1.0):
    return (scale * torch.randn(*shape, generator=gen)).to(device)

cases = 0
for dtype, tol in ((torch.float32, 2e-5), (torch.bfloat16, 3e-2)):
    for n, k, tiles in ((64, 128, None), (96, 192, (4, 64, 1)), (32, 512, (8, 128, 4))):
        rg.OVERRIDE = tiles
        for rows in (1, 3, 5, 16):
            x, norm = rand(rows, k).to(dtype), (1 + 0.1 * rand(k)).to(dtype)
            w, bias = rand(n, k, scale=0.05).to(dtype), rand(n).to(dtype)
            for b in (None, bias):
                out = torch.full((rows, n), 7.0, device=device, dtype=dtype)
                rg.norm_gemv(x, norm, w, b, 1e-5, out=out)
                fb = None if b is None else b.float()
                expected = kd.reference_norm_gemv(x.float(), norm.float(), w.float(), fb, 1e-5)
                torch.testing.assert_close(out.float(), expected, rtol=tol, atol=tol)
                cases += 1
            logits = torch.empty(rows, n, device=device, dtype=torch.float32)  # the head
            rg.norm_gemv(x, norm, w, None, 1e-5, out=logits)
            expected = kd.reference_norm_gemv(x.float(), norm.float(), w.float(), None, 1e-5)
            torch.testing.assert_close(logits, expected, rtol=tol, atol=tol)
            for silu, width in ((False, k), (True, 2 * k)):
                inp = rand(rows, width).to(dtype)
                residual = rand(rows, n).to(dtype)
                wanted = residual.float().clone()
                expected = kd.reference_gemv_add_(wanted, inp.float(), w.float(), bias.float(), silu)
                got = rg.gemv_add_(residual, inp, w, bias, silu)
                assert got is residual
                torch.testing.assert_close(residual.float(), expected, rtol=tol, atol=tol)
                cases += 1
rg.OVERRIDE = None

# The plain product DeepSeek-V4's linears call: one row on gemv.py's kernel, 2..16 on the row kernel
# (float32 out for its verify head), more on torch.
for dtype, tol in ((torch.float32, 2e-5), (torch.bfloat16, 3e-2)):
    w = rand(64, 128, scale=0.05).to(dtype)
    for rows in (1, 7, 17):
        x = rand(rows, 128).to(dtype)
        torch.testing.assert_close(rg.linear(x, w).float(), x.float() @ w.float().t(), rtol=tol, atol=tol)
        cases += 1
    logits = rg.gemv_rows(x[:9], w, torch.empty(9, 64, device=device))
    torch.testing.assert_close(logits, x[:9].float() @ w.float().t(), rtol=tol, atol=tol)
    cases += 1

# RoPE + cache write for T tokens at positions pos..pos+T-1.
heads, kv, dim, context = 4, 2, 32, 24
angles = torch.outer(torch.arange(context).float(), torch.rand(dim // 2, generator=gen))
for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
    cos = torch.cat([angles.cos(), angles.cos()], 1).to(device, dtype)
    sin = torch.cat([-angles.sin(), angles.sin()], 1).to(device, dtype)
    for qk_norm in (None, (1 + 0.1 * rand(heads + kv, dim)).to(dtype)):
        for pos, tokens in ((0, 5), (11, 13)):
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


def test_each_row_kernel_equals_its_torch_form() -> None:
    """Norm + GEMV (with and without bias, float32 logits), GEMV + residual (plain and SiLU·up) for
    1, 3, 5 and 16 rows under three tilings, the plain product by row count, and RoPE + cache
    write for several tokens."""
    assert "kernels ok 112" in run_triton_check(_KERNEL_CHECK)


_MODEL_CHECK = """
import tempfile
from pathlib import Path
import torch
from ds4desk.engine.kernels.dense import gemv as kd
from ds4desk.engine.kernels.dense import rows_gemv as rg
from ds4desk.engine.kernels.dense import decode_attention as da
from ds4desk.engine.loader import load_model
from tests.engine.tiny_dense import save_tiny

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
da.SWITCH.forced = True
calls = {"norm_gemv": 0, "gemv_add_": 0}
for name in calls:
    def counted(*args, _real=getattr(rg, name), _name=name, **kwargs):
        calls[_name] += 1
        return _real(*args, **kwargs)
    setattr(rg, name, counted)
root = Path(tempfile.mkdtemp())
for family in ("llama", "mistral", "qwen2", "qwen3"):
    source = save_tiny(family, root / family)[1]
    model = load_model(source, device, torch.float32).model
    model.decode_attention = "triton"
    model.allocate_cache(64)
    prompt = torch.randint(0, 256, (9,), generator=torch.Generator().manual_seed(3)).to(device)
    with torch.inference_mode():
        model.forward(prompt, 0, "none")
        for pos, count in ((9, 5), (12, 16), (20, 1)):  # past mistral's window of 8
            tokens = torch.randint(0, 256, (count,), generator=torch.Generator().manual_seed(pos)).to(device)
            at = torch.tensor([pos], device=device)
            last = torch.tensor([count], device=device)
            before = model._cache.clone()
            with kd.SWITCH.force(False):
                assert not model._rows_fit(model._shards[0])
                expected = model.verify_graphable(tokens, at, 48)
                expected_cache = model._cache.clone()
                model._cache.copy_(before)
                expected_piece = model.prefill_graphable(tokens, at, last, 48)
            model._cache.copy_(before)
            before_calls = dict(calls)
            with kd.SWITCH.force(True):
                assert model._rows_fit(model._shards[0])
                got = model.verify_graphable(tokens, at, 48)
                torch.testing.assert_close(model._cache, expected_cache, rtol=1e-5, atol=1e-5)
                model._cache.copy_(before)
                got_piece = model.prefill_graphable(tokens, at, last, 48)
            layers = len(model._shards[0].plans)
            assert calls["gemv_add_"] - before_calls["gemv_add_"] == 2 * 2 * layers
            assert calls["norm_gemv"] - before_calls["norm_gemv"] == 2 * (2 * layers + 1)
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(got_piece, expected_piece, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(got_piece, expected[-1], rtol=1e-4, atol=1e-4)
            model._cache.copy_(before)
    print(family, "ok")
"""


def test_the_verify_step_and_prompt_piece_on_the_row_kernels_equal_the_torch_path() -> None:
    """Every family switch (Llama's tied head, Mistral's window, Qwen2's biases, Qwen3's per-head
    norms), 1 to 16 tokens: the logits of all rows (verify) and of the last (piece), and the cache."""
    stdout = run_triton_check(_MODEL_CHECK)
    for family in ("llama", "mistral", "qwen2", "qwen3"):
        assert f"{family} ok" in stdout
