"""kernels/launch.py: every kernel module declares one switch with the shared API, the switches are
off the CPU by default, and forcing one restores what was there before."""

from __future__ import annotations

import importlib
from collections.abc import Iterator

import pytest
import torch

from ds4desk.engine.kernels import launch

KERNEL_MODULES = (
    "dense.decode_attention",
    "dense.gemv",
    "dense.norm_rows",
    "dense.silu_mul",
    "deepseek_v4.compress_step",
    "deepseek_v4.decode_attention",
    "deepseek_v4.decode_index",
    "deepseek_v4.hc_fused",
    "deepseek_v4.hc_kernel",
    "deepseek_v4.index_scores",
    "deepseek_v4.moe_tail",
    "deepseek_v4.norm_rope",
    "deepseek_v4.prefill_attention",
    "deepseek_v4.route",
    "quant.fp4",
    "quant.fp8",
    "quant.gguf_triton",
    "qwen3_5.causal_conv",
    "qwen3_5.chunked_delta",
    "qwen3_5.gated_norm",
    "qwen3_5.gates",
    "qwen3_5.linear_decode",
)


def test_every_kernel_module_declares_its_switch_and_one_check() -> None:
    names = [switch.name for switch in launch.switches()]
    assert names == sorted(
        [
            *KERNEL_MODULES,
            "launch.pdl",
            "quant.fp8_scaled_mm",
            "quant.gguf_cpu_bf16",
            "quant.gguf_cpu_gemm",
            "quant.gguf_cpu_rows",
        ]
    )
    for name in KERNEL_MODULES:
        module = importlib.import_module(f"ds4desk.engine.kernels.{name}")
        assert module.SWITCH.name == name and module.SWITCH.doc and callable(module.enabled)
        # The torch form the kernel is held to: `reference`, or `reference_<op>` for several ops.
        assert any(attr == "reference" or attr.startswith("reference_") for attr in vars(module)), name


@pytest.mark.parametrize("name", KERNEL_MODULES)
def test_the_cpu_takes_the_torch_form_by_default(name: str) -> None:
    module = importlib.import_module(f"ds4desk.engine.kernels.{name}")
    switch: launch.Switch = module.SWITCH
    assert switch.forced is None and not switch.kernel_on_cpu
    args = (4,) if name.endswith("hc_fused") or name.endswith("hc_kernel") else ()
    for where in (torch.zeros(1), torch.device("cpu")):
        assert not module.enabled(where, *args)
    with switch.force(False):
        assert not module.enabled(torch.zeros(1), *args)


@pytest.fixture
def scratch() -> Iterator[launch.Switch]:
    """A switch of the test's own (off where nothing forces it), left out of the listing after it."""
    switch = launch.Switch("test.scratch", "a switch of this test", lambda where: False)
    yield switch
    del launch._SWITCHES[switch.name]


def test_force_restores_the_previous_value_also_after_an_error(scratch: launch.Switch) -> None:
    switch = scratch
    assert not switch.on(torch.zeros(1))
    with switch.force(True):
        assert switch.on(torch.zeros(1)) and switch.forced is True
        with switch.force(False):
            assert not switch.on(torch.zeros(1))
        assert switch.forced is True
    assert switch.forced is None
    with pytest.raises(RuntimeError), switch.force(True):
        raise RuntimeError("inside")
    assert switch.forced is None


def test_several_switches_are_forced_at_once_by_switch_or_name() -> None:
    from ds4desk.engine.kernels.deepseek_v4 import route
    from ds4desk.engine.kernels.dense import silu_mul

    cpu = torch.zeros(1)
    with launch.force({silu_mul.SWITCH: True, "deepseek_v4.route": True, launch.PDL: False}):
        assert silu_mul.enabled(cpu) and route.enabled(cpu) and launch.PDL.forced is False
    assert silu_mul.SWITCH.forced is None and route.SWITCH.forced is None and launch.PDL.forced is None
    with pytest.raises(KeyError, match="no kernel switch"), launch.force({"dense.nothing": True}):
        pass


def test_an_ops_body_runs_the_kernel_on_cuda_tensors_or_where_a_test_asks(scratch: launch.Switch) -> None:
    assert not scratch.kernel_runs_on(torch.zeros(1))
    scratch.kernel_on_cpu = True
    assert scratch.kernel_runs_on(torch.zeros(1))


def test_no_custom_op_gives_a_mutated_argument_a_default() -> None:
    """torch 2.11's dispatcher drops trailing arguments left at their defaults before the custom
    op's in-place bookkeeping looks the mutated ones up by position: a defaulted mutated argument
    is then out of range (IndexError on the GPU machine's torch; newer torch fills defaults first)."""
    for name in KERNEL_MODULES:
        importlib.import_module(f"ds4desk.engine.kernels.{name}")
    checked = 0
    for op_name in torch.ops.ds4desk:
        schema = getattr(torch.ops.ds4desk, op_name).default._schema
        for argument in schema.arguments:
            if argument.alias_info is not None and argument.alias_info.is_write:
                assert not argument.has_default_value(), f"{schema.name}: {argument.name}"
                checked += 1
    assert checked >= 2  # decode_attention's ordered and v4_route's x_read at least
