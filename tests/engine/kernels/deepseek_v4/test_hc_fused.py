"""DeepSeek-V4's fused hyper-connection sites (v4_hc_fused): the eager bodies equal the model's own
functions, each public function is one op, the Triton kernels (on CUDA, or Triton's CPU interpreter)
equal the eager math, and a decode step through the fused path equals the unfused one."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ds4desk.engine.kernels.deepseek_v4 import hc_fused as v4_hc_fused
from ds4desk.engine.kernels.deepseek_v4 import hc_kernel as v4_hc_kernel
from ds4desk.engine.loader import load_model
from ds4desk.engine.make_tiny import make_tiny
from ds4desk.engine.models.deepseek_v4 import model as v4
from ds4desk.engine.models.deepseek_v4 import ops
from tests.engine.op_names import OpNames
from tests.engine.tiny_dense import source_from_folder
from tests.engine.triton_check import run_triton_check

M, ITERS, HC_EPS, EPS = 4, 20, 1e-6, 1e-6
ROWS = (2 + M) * M


def site_inputs(
    count: int, dim: int, seed: int, dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    """Random streams, a previous block's (y, post, comb) as a site makes them, and a site's weights."""
    gen = torch.Generator().manual_seed(seed)
    gates, comb = v4_hc_kernel.reference(
        3 * torch.randn(count, ROWS, generator=gen),
        0.5 + torch.rand(3, generator=gen),
        torch.randn(ROWS, generator=gen),
        M,
        ITERS,
        HC_EPS,
    )
    return {
        "streams": torch.randn(count, M, dim, generator=gen).to(dtype),
        "y": torch.randn(count, dim, generator=gen).to(dtype),
        "gates": gates,  # post is gates[:, M:], a strided view as in the model
        "comb": comb,
        "fn": torch.randn(ROWS, M * dim, generator=gen) / (M * dim) ** 0.5,
        "head_fn": torch.randn(M, M * dim, generator=gen) / (M * dim) ** 0.5,
        "scale": 0.5 + torch.rand(3, generator=gen),
        "base": torch.randn(ROWS, generator=gen),
        "weight": 1 + 0.1 * torch.randn(dim, generator=gen),
    }


def model_site(x: dict[str, torch.Tensor], expand: bool) -> tuple[torch.Tensor, ...]:
    """What the model computes today: ops.expand, then hc_mix, hc_weights, collapse, rms_norm."""
    streams = x["streams"]
    if expand:
        streams = ops.expand(streams, x["y"], x["gates"][:, M:], x["comb"])
    z, streams32 = ops.hc_mix(streams, x["fn"], EPS)
    gates, comb = v4_hc_kernel.reference(z, x["scale"], x["base"], M, ITERS, HC_EPS)
    h = ops.rms_norm(ops.collapse(streams32, gates[:, :M]), x["weight"], EPS, streams.dtype)
    return streams, h, gates[:, M:], comb


@pytest.mark.parametrize("count", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_eager_bodies_equal_the_model_functions(count: int, dtype: torch.dtype) -> None:
    x = site_inputs(count, 64, seed=count, dtype=dtype)
    post = x["gates"][:, M:]
    expanded = ops.expand(x["streams"], x["y"], post, x["comb"])
    assert torch.equal(v4_hc_fused.reference_expand(x["streams"], x["y"], post, x["comb"]), expanded)
    z, streams32 = ops.hc_mix(expanded, x["fn"], EPS)
    assert torch.equal(v4_hc_fused.reference_mix(expanded, x["fn"], EPS), z)
    pre = x["gates"][:, :M]
    h = ops.rms_norm(ops.collapse(streams32, pre), x["weight"], EPS, dtype)
    assert torch.equal(v4_hc_fused.reference_collapse_norm(expanded, pre, x["weight"], EPS, dtype), h)
    for expand in (False, True):
        previous = (x["y"], post, x["comb"]) if expand else None
        ours = v4_hc_fused.site(
            x["streams"], previous, x["fn"], x["scale"], x["base"], x["weight"], M, ITERS, HC_EPS, EPS
        )
        for got, want in zip(ours, model_site(x, expand), strict=True):
            assert got.dtype == want.dtype and torch.equal(got, want)
    # The inputs mattered: the expand changed the streams and the site's comb is no permutation.
    assert not torch.equal(expanded, x["streams"]) and ours[3].std() > 0.01


def test_each_fused_function_is_one_op(monkeypatch: pytest.MonkeyPatch) -> None:
    x = site_inputs(2, 32, seed=4)
    post, pre = x["gates"][:, M:], x["gates"][:, :M]
    args = (x["fn"], x["scale"], x["base"], x["weight"], M, ITERS, HC_EPS, EPS)
    calls = {
        "v4_hc_site": lambda: v4_hc_fused.site(x["streams"], None, *args),
        "v4_hc_expand_site": lambda: v4_hc_fused.site(x["streams"], (x["y"], post, x["comb"]), *args),
        "v4_hc_expand_mix": lambda: v4_hc_fused.expand_mix(
            x["streams"], x["y"], post, x["comb"], x["fn"], EPS
        ),
        "v4_hc_collapse_norm": lambda: v4_hc_fused.collapse_norm(
            x["streams"], pre, x["weight"], EPS, torch.float32
        ),
    }
    for name, call in calls.items():
        seen = OpNames()
        with torch.inference_mode(), seen:
            call()
        assert [n for n in seen.names if n.startswith("v4_hc")] == [name], name
        assert "bmm" not in seen.names and "mm" not in seen.names, name


def test_the_cpu_runs_the_eager_form_by_default() -> None:
    assert v4_hc_fused.SWITCH.forced is None
    assert not v4_hc_fused.enabled(torch.zeros(1, M, 8), M)


# --- the Triton kernels against the eager math ----------------------------------------------------

_TRITON_CHECK = """
import torch
from ds4desk.engine.kernels.deepseek_v4 import hc_fused as v4_hc_fused
from tests.engine.kernels.deepseek_v4.test_hc_fused import EPS, HC_EPS, ITERS, M, model_site, site_inputs

kernels = v4_hc_fused._kernels()
assert kernels is not None
device = "cuda" if torch.cuda.is_available() else "cpu"
v4_hc_fused.SWITCH.kernel_on_cpu = True  # the interpreter runs the kernels on CPU tensors
# D = 40: a partial mix block and a partial collapse block; 256: several whole blocks; 600 at two
# tokens: three collapse programs a token, the last one partial; 20 and 70 tokens: a program a
# token's row and the tiled mix (70: two token blocks, a partial one; 272: a partial dim block).
for dtype, tol in ((torch.float32, 2e-5), (torch.bfloat16, 2e-2)):
    for count, dim in ((1, 40), (3, 256), (1, 256), (2, 600), (20, 40), (70, 272)):
        x = {k: v.to(device) for k, v in site_inputs(count, dim, seed=count + dim, dtype=dtype).items()}
        post, pre = x["gates"][:, M:], x["gates"][:, :M]
        args = (x["fn"], x["scale"], x["base"], x["weight"], M, ITERS, HC_EPS, EPS)
        for expand in (False, True):
            previous = (x["y"], post, x["comb"]) if expand else None
            ours = v4_hc_fused.site(x["streams"], previous, *args)
            want = model_site(x, expand)
            for name, got, ref in zip(("streams", "h", "post", "comb"), ours, want, strict=True):
                assert got.dtype == ref.dtype and got.shape == ref.shape, name
                torch.testing.assert_close(got.float(), ref.float(), rtol=tol, atol=tol, msg=name)
        streams, z = v4_hc_fused.expand_mix(x["streams"], x["y"], post, x["comb"], x["head_fn"], EPS)
        want_streams = v4_hc_fused.reference_expand(x["streams"], x["y"], post, x["comb"])
        torch.testing.assert_close(streams.float(), want_streams.float(), rtol=tol, atol=tol)
        want_z = v4_hc_fused.reference_mix(want_streams, x["head_fn"], EPS)
        torch.testing.assert_close(z, want_z, rtol=tol, atol=tol)
        h = v4_hc_fused.collapse_norm(x["streams"], pre, x["weight"], EPS, dtype)
        want_h = v4_hc_fused.reference_collapse_norm(x["streams"], pre, x["weight"], EPS, dtype)
        assert h.dtype == dtype
        torch.testing.assert_close(h.float(), want_h.float(), rtol=tol, atol=tol)
print("triton ok")
"""


def test_the_triton_kernels_equal_the_eager_math() -> None:
    """On CUDA the real kernels; without a GPU, Triton's interpreter (the same kernel source, run by
    numpy). Skipped where Triton is not installed."""
    assert "triton ok" in run_triton_check(_TRITON_CHECK)


# --- the model's decode step ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny_v4")
    make_tiny("deepseek_v4", folder, seed=3)
    return folder


def decode_steps(folder: Path, steps: int, device: str = "cpu") -> list[torch.Tensor]:
    """Logits of a 5-token prefill and `steps` greedy decode_graphable steps after it."""
    model = load_model(source_from_folder(folder), torch.device(device), torch.float32).model
    assert isinstance(model, v4.DeepseekV4Model)
    model.allocate_cache(32)
    out = []
    with torch.inference_mode():
        logits = model.forward(torch.tensor([5, 17, 3, 9, 30], device=device), 0, "last")
        for pos in range(5, 5 + steps):
            token = torch.tensor([int(logits.argmax())], device=device)
            logits = model.decode_graphable(token, torch.tensor([pos], device=device), 32)
            model.set_length(pos + 1)
            out.append(logits)
    return out


def fused_sites(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Force the fused sites on and count the model's calls of v4_hc_fused.site."""
    monkeypatch.setattr(v4_hc_fused.SWITCH, "forced", True)
    seen: list[str] = []
    original = v4_hc_fused.site

    def counted(*args, **kwargs):
        seen.append("site")
        return original(*args, **kwargs)

    monkeypatch.setattr(v4_hc_fused, "site", counted)
    return seen


def prefill(folder: Path, chunk: int, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """All logits of a 40-token prompt prefilled in chunks of `chunk`, and the "last" logits of a
    second prefill of the same prompt (the head's one-row slice of the fused path)."""
    model = load_model(source_from_folder(folder), torch.device(device), torch.float32).model
    assert isinstance(model, v4.DeepseekV4Model)
    model.allocate_cache(64)
    ids = torch.tensor([(7 * i + 3) % 50 for i in range(40)], device=device)
    with torch.inference_mode():
        logits = torch.cat([model.forward(ids[s : s + chunk], s, "all") for s in range(0, 40, chunk)])
        model.forward(ids[:-1], 0, "none")
        last = model.forward(ids[-1:], 39, "last")
    return logits, last


def test_the_fused_prefill_equals_the_unfused_one(tiny: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    eager, eager_last = prefill(tiny, 20)
    seen = fused_sites(monkeypatch)
    fused, fused_last = prefill(tiny, 20)
    assert len(seen) == 4 * 2 * 4  # forwards x sites x layers: the fused path really ran
    torch.testing.assert_close(fused, eager, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fused_last, eager_last, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fused_last, fused[-1], rtol=1e-5, atol=1e-5)


def test_the_fused_decode_step_equals_the_unfused_one(tiny: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    eager = decode_steps(tiny, steps=3)
    seen = fused_sites(monkeypatch)
    fused = decode_steps(tiny, steps=3)
    assert len(seen) == (1 + 3) * 2 * 4  # (prefill + steps) x sites x layers: the fused path ran
    for ours, ref in zip(fused, eager, strict=True):
        # On the CPU the ops' bodies are the model's eager math, only regrouped: equal to rounding.
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)


def test_the_fused_decode_step_with_the_triton_kernels(tiny: Path) -> None:
    """The whole decode step with the kernels (interpreter without a GPU) equals the eager one."""
    script = f"""
import pathlib, torch
from ds4desk.engine.kernels.deepseek_v4 import hc_fused as v4_hc_fused
from tests.engine.kernels.deepseek_v4.test_hc_fused import decode_steps

folder = pathlib.Path({str(tiny)!r})
device = "cuda" if torch.cuda.is_available() else "cpu"
with v4_hc_fused.SWITCH.force(False):
    eager = decode_steps(folder, 2, device)
v4_hc_fused.SWITCH.forced = True
v4_hc_fused.SWITCH.kernel_on_cpu = True  # the interpreter runs the kernels on CPU tensors
fused = decode_steps(folder, 2, device)
for ours, ref in zip(fused, eager, strict=True):
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)
print("decode ok")
"""
    assert "decode ok" in run_triton_check(script)


def test_the_fused_prefill_with_the_triton_kernels(tiny: Path) -> None:
    """Prefill chunks of 40 tokens (the tiled mix) and of 8 (the few-token kernels) with the kernels
    (interpreter without a GPU) equal the eager prefill."""
    script = f"""
import pathlib, torch
from ds4desk.engine.kernels.deepseek_v4 import hc_fused as v4_hc_fused
from tests.engine.kernels.deepseek_v4.test_hc_fused import prefill

folder = pathlib.Path({str(tiny)!r})
device = "cuda" if torch.cuda.is_available() else "cpu"
with v4_hc_fused.SWITCH.force(False):
    eager, eager_last = prefill(folder, 40, device)
v4_hc_fused.SWITCH.forced = True
v4_hc_fused.SWITCH.kernel_on_cpu = True  # the interpreter runs the kernels on CPU tensors
for chunk in (40, 8):
    fused, fused_last = prefill(folder, chunk, device)
    torch.testing.assert_close(fused, eager, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(fused_last, eager_last, rtol=1e-4, atol=1e-4)
print("prefill ok")
"""
    assert "prefill ok" in run_triton_check(script)
