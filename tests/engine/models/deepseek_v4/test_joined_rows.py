"""DeepSeek-V4's linears that read one input, joined at materialize (modules.join_rows): the
shared expert's gate_proj and up_proj, attention's q_a_proj and kv_proj. One tensor holds their
rows (and an FP8 pair's scales), the decode step runs one GEMV for them, and its output equals the
unjoined linears'; a GGUF's blocks, FP8 rows in partial 128-row blocks, and weights replaced after
the join stay apart."""

from __future__ import annotations

import torch
from torch import nn

from ds4desk.engine.make_tiny import TINY_CONFIG
from ds4desk.engine.models.deepseek_v4.config import DeepseekV4Config
from ds4desk.engine.models.deepseek_v4.model import DeepseekV4Model
from ds4desk.engine.models.deepseek_v4.modules import Fp8Weight, SharedExpert, Weight, join_rows, joined
from tests.engine.triton_check import run_triton_check

CONFIG = DeepseekV4Config.from_hf(TINY_CONFIG | {"moe_intermediate_size": 128, "hidden_size": 256})


def expert(fp8: bool, packed: dict[str, int] | None = None, device: str = "cpu") -> SharedExpert:
    """Materialized on `device` and joined there, as the model does (moving it after the join, as
    Module.to does, gives each parameter storage of its own: the two GEMVs again)."""
    with torch.device("meta"):
        shared = SharedExpert(CONFIG, torch.float32, fp8, packed, "s")
    shared = shared.to_empty(device=device)
    shared.join_gate_up()
    return shared


def test_gate_and_up_become_halves_of_one_tensor() -> None:
    for fp8 in (False, True):
        shared = expert(fp8)
        fused = shared.gate_up()
        assert len(fused) == (2 if fp8 else 1)
        weight = fused[0]
        assert weight.shape == (256, 256)
        with torch.no_grad():
            shared.gate_proj.weight.fill_(1)  # the loader copies in place
            shared.up_proj.weight.fill_(2)
        assert weight[:128].float().eq(1).all() and weight[128:].float().eq(2).all()
        shared.up_proj.weight = nn.Parameter(shared.up_proj.weight.clone(), requires_grad=False)
        assert shared.gate_up() == ()  # replaced since: the two GEMVs again


def test_blocks_and_partial_fp8_blocks_stay_apart() -> None:
    packed = {"s.gate_proj.weight": 8, "s.up_proj.weight": 8, "s.down_proj.weight": 8}  # Q8_0
    assert expert(False, packed).gate_up() == ()
    narrow = DeepseekV4Config.from_hf(TINY_CONFIG | {"moe_intermediate_size": 64, "hidden_size": 256})
    with torch.device("meta"):
        shared = SharedExpert(narrow, torch.float32, True, None, "s")
    shared = shared.to_empty(device="cpu")
    shared.join_gate_up()
    assert shared.gate_up() == ()


def test_a_materialized_model_joins_its_shared_experts_and_q_a_with_kv() -> None:
    with torch.device("meta"):
        model = DeepseekV4Model(DeepseekV4Config.from_hf(TINY_CONFIG), torch.float32)
    model.materialize(torch.device("cpu"))
    assert all(layer.mlp.shared_experts.gate_up() for layer in model.model.layers)
    for layer in model.model.layers:
        attn = layer.self_attn
        (both,) = attn.q_a_kv()
        assert both.shape[0] == attn.q_a_proj.weight.shape[0] + attn.kv_proj.weight.shape[0]


def test_three_fp8_linears_join_in_order_and_a_mix_of_kinds_does_not() -> None:
    holders = [Fp8Weight((rows, 256)) for rows in (128, 256, 128)]
    tensors = join_rows(*holders)
    assert [t.shape for t in tensors] == [(512, 256), (4, 2)]
    assert holders[1].weight.data_ptr() == tensors[0][128:].data_ptr()
    assert holders[2].weight_scale_inv.data_ptr() == tensors[1][3:].data_ptr()
    assert joined(tensors, *holders) == tensors and joined(tensors, holders[0], holders[2]) == ()
    assert join_rows(Fp8Weight((128, 256)), Weight((128, 256), torch.bfloat16)) == ()


_DECODE_CHECK = """
import torch
from types import SimpleNamespace
from ds4desk.engine.kernels.dense import gemv
from ds4desk.engine.kernels.quant import fp8
from ds4desk.engine.models.deepseek_v4 import moe, ops
from tests.engine.models.deepseek_v4.test_joined_rows import CONFIG, expert
from tests.engine.kernels.quant.samples import fp8_weight, rel_error
from tests.engine.op_names import OpNames

gemv.SWITCH.forced = True
fp8.SWITCH.forced = True
device = "cuda" if torch.cuda.is_available() else "cpu"
launches = []


def recorded(launch):
    # Records the rows of each launch's weight, then launches.
    return lambda *args, **kwargs: launches.append(args[1].shape[0]) or launch(*args, **kwargs)


moe.fp8_row_ = recorded(moe.fp8_row_)
gemv.gemv = recorded(gemv.gemv)
mixin = SimpleNamespace(config=CONFIG)
gen = torch.Generator().manual_seed(0)
for fp8_weights in (False, True):
    shared = expert(fp8_weights, device=device)
    with torch.no_grad():
        for seed, holder in enumerate((shared.gate_proj, shared.up_proj, shared.down_proj)):
            if fp8_weights:
                q, scale, _ = fp8_weight(*holder.weight.shape, seed=seed)
                holder.weight.copy_(q)
                holder.weight_scale_inv.copy_(scale)
            else:
                holder.weight.copy_(torch.randn(holder.weight.shape, generator=gen) * 0.1)
    dtype = torch.float32 if fp8_weights else shared.gate_proj.weight.dtype
    x = torch.randn(1, 256, generator=gen).to(device, dtype)
    routed = torch.randn(1, 256, generator=gen).to(device, dtype)
    want = routed + ops.shared_expert(shared, x, CONFIG.swiglu_limit)
    launches.clear()
    got = moe.MixtureOfExperts._add_shared_expert(mixin, shared, x, routed.clone())
    print("fp8" if fp8_weights else "plain", launches, rel_error(got, want) < 1e-5)

# Attention's q_a and kv: one product, split, equal to the two.
from ds4desk.engine.models.deepseek_v4.modules import Fp8Weight, join_rows, joined
holders = [Fp8Weight((rows, 256)).to(device) for rows in (256, 128)]
tensors = join_rows(*holders)  # on the device, as materialize joins
with torch.no_grad():
    for seed, holder in enumerate(holders):
        q, scale, _ = fp8_weight(*holder.weight.shape, seed=10 + seed)
        holder.weight.copy_(q)
        holder.weight_scale_inv.copy_(scale)
attn = SimpleNamespace(q_a_proj=holders[0], kv_proj=holders[1], q_a_kv=lambda: joined(tensors, *holders))
x = torch.randn(1, 256, generator=gen).to(device, torch.bfloat16)
seen = OpNames()
with seen:
    q_a, kv = ops.q_a_kv(x, attn)
separate = [ops.linear(x, holder) for holder in holders]
print("q_a_kv", seen.names.count("fp8_gemv"), torch.equal(q_a, separate[0]) and torch.equal(kv, separate[1]))
"""


def test_one_decode_gemv_runs_joined_linears_and_equals_them() -> None:
    stdout = run_triton_check(_DECODE_CHECK)
    # gate | up as one launch of 256 rows; FP8's down projection (256 rows, the SwiGLU inside) runs
    # on the same row kernel, bf16's on gemv_add_ (not recorded).
    assert "plain [256] True" in stdout and "fp8 [256, 256] True" in stdout, stdout
    assert "q_a_kv 1 True" in stdout, stdout  # one FP8 GEMV, the same bits as two
