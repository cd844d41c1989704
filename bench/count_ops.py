"""Count the aten ops of DeepSeek-V4's graphable decode step and of one prefill chunk, per phase.

    python3 bench/count_ops.py [--prompt 600] [--chunk 512] [--dtype bfloat16] [--verbose] [--json]
    PYTHONPATH=. python3 bench/count_ops.py --cuda [--baseline-file OLD/deepseek_v4.py]   (on a GPU)

Inside a CUDA graph every kernel still costs a few microseconds of launch and tail, so at batch 1
the op count, not the FLOPs, sets the decode speed. This runs on the CPU: the model has the layer
kinds, routing, hc_mult, Sinkhorn iterations, experts / top-k, window, rates and index top-k of
bench/gpu_deepseek_v4.py's Flash-shaped config, only narrower (op counts do not depend on widths).
Composite ops are counted by the kernels they decompose into; views, allocations and other ops that
launch nothing are not counted. Counts are printed twice: with the hyper-connection weights as the
eager ops (CPU, or a GPU without Triton) and as the one Triton kernel they are on an NVIDIA GPU.
In the fused count a decode step's hyper-connection sites are also fused (v4_hc_fused): one op each,
which is two Triton kernels on the GPU (split-K expand + mix, then weights + collapse + norm).

Measured with it (bf16, views excluded; 2026-11-30):
- before (the first graphable decode step): decode 2,030 ops, prefill chunk 2,403.
- after: decode 542 fused (1,214 eager), prefill chunk 672 fused (1,344 eager).
- with the fused hc sites (--prompt 200 --chunk 64): decode 458 ops (hc: 13, the 8 sites one op each).
- with the decode norm / rope as one op a use (v4_norm_rope; --prompt 200 --chunk 64): decode 232 -> 188.
- with the decode indexer pick as one op (v4_decode_index; --prompt 2200 --chunk 512, so that the CSA
  layers hold more rows than index_topk; 2026-12-06): decode 188 -> 170.

--cuda builds the full-width model on the GPU and reports the kernels a decode step launches (from
the profiler), the CUDA-graph decode time, eager decode time and prefill tok/s, for this version and
for --baseline-file, then both versions' bf16 logits against float32 ones on the same weights.
On one H200 (torch 2.11), at 586 decode ops (before the last two rounds of norm / rope merging):
decode graph 4.91 -> 2.57 ms/step (2,112 -> 651 kernels), prefill at 4k 12.6k -> 24.5k tok/s;
bf16 vs float32 logits 3.3e-2 / 3.1e-2 -> 3.0e-2 / 2.5e-2 (prefill / decode).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ds4desk.engine.kernels import launch
from ds4desk.engine.kernels.deepseek_v4 import compress_step as v4_compress_step
from ds4desk.engine.kernels.deepseek_v4 import decode_attention as v4_decode_attention
from ds4desk.engine.kernels.deepseek_v4 import decode_index as v4_decode_index
from ds4desk.engine.kernels.deepseek_v4 import hc_fused as v4_hc_fused
from ds4desk.engine.kernels.deepseek_v4 import hc_kernel as v4_hc_kernel
from ds4desk.engine.kernels.deepseek_v4 import norm_rope as v4_norm_rope
from ds4desk.engine.kernels.deepseek_v4 import prefill_attention as v4_prefill_attention
from ds4desk.engine.kernels.deepseek_v4 import route as v4_route
from ds4desk.engine.make_tiny import TINY_CONFIG, random_state
from ds4desk.engine.models.deepseek_v4 import config as v4_config
from ds4desk.engine.models.deepseek_v4 import model as v4
from ds4desk.engine.models.deepseek_v4 import ops as v4_ops

# Every fused op of the model (a custom op: one op here, its kernels on the GPU).
FUSED_MODULES = (
    v4_hc_kernel,
    v4_hc_fused,
    v4_decode_attention,
    v4_decode_index,
    v4_compress_step,
    v4_prefill_attention,
    v4_route,
    v4_norm_rope,
)

# bench/gpu_deepseek_v4.py's FLASH_SHAPES with the widths cut (heads, experts, top-k, window and
# rates kept: they decide loops and op counts).
SHAPES: dict[str, Any] = {
    **TINY_CONFIG,
    "vocab_size": 512,
    "hidden_size": 128,
    "num_attention_heads": 64,
    "head_dim": 64,
    "partial_rotary_factor": 8 / 64,
    "q_lora_rank": 64,
    "o_groups": 8,
    "o_lora_rank": 32,
    "moe_intermediate_size": 64,
    "n_routed_experts": 8,
    "num_experts_per_tok": 6,
    "num_hidden_layers": 4,
    "layer_types": [v4_config.SLIDING, v4_config.CSA, v4_config.HCA, v4_config.CSA],
    "mlp_layer_types": [v4_config.HASH_MOE, v4_config.MOE, v4_config.MOE, v4_config.MOE],
    "compress_rates": {v4_config.CSA: 4, v4_config.HCA: 128},
    "sliding_window": 128,
    "index_n_heads": 64,
    "index_head_dim": 32,
    "index_topk": 512,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
}

# Ops that only alias or describe storage (no kernel), besides those the schema marks as views.
# Allocations (empty*) launch nothing either, and scalar_tensor is the host-side wrapping of a Python
# number (torch.where(c, 0.0, x)) that a CUDA kernel takes as an argument.
_NO_KERNEL = {
    *("_unsafe_view", "detach", "alias", "lift_fresh", "_reshape_alias", "set_", "resize_"),
    *("empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "scalar_tensor"),
}
# Composite on the CPU but one fused kernel on CUDA (torch >= 2.8): counted as one op.
_ONE_CUDA_KERNEL = {"_fused_rms_norm"}


class OpCounter(TorchDispatchMode):
    """Counts non-view aten ops under the innermost active phase label."""

    def __init__(self) -> None:
        super().__init__()
        self.phases: list[str] = ["other"]
        self.counts: Counter[str] = Counter()
        self.names: dict[str, Counter[str]] = {}

    def reset(self) -> None:
        self.counts.clear()
        self.names.clear()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        # A composite op (matmul, softmax, reshape, ...) is counted by the kernels it runs: it is
        # decomposed here, with this mode active again so the parts are seen.
        if name not in _ONE_CUDA_KERNEL and torch._C._dispatch_has_kernel_for_dispatch_key(
            func.name(), "CompositeImplicitAutograd"
        ):
            with self:
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        out = func(*args, **kwargs)
        if not func.is_view and name not in _NO_KERNEL:
            phase = self.phases[-1]
            self.counts[phase] += 1
            self.names.setdefault(phase, Counter())[name] += 1
        return out

    @contextmanager
    def phase(self, label: str) -> Iterator[None]:
        self.phases.append(label)
        try:
            yield
        finally:
            self.phases.pop()


def _label_methods(model: v4.DeepseekV4Model, counter: OpCounter) -> None:
    """Wrap the model's phase methods (those that exist) on the instance so their ops get a label."""
    types = model.config.layer_types

    def wrap(name: str, label: Callable[..., str]) -> None:
        method = getattr(model, name, None)
        if method is None:
            return

        def labelled(*args: Any, **kwargs: Any) -> Any:
            with counter.phase(label(*args)):
                return method(*args, **kwargs)

        setattr(model, name, labelled)

    for name in ("_hc_site", "_hc_weights", "_hc_pre", "_hc_post", "_hc_site_fused", "_hc_head_fused"):
        wrap(name, lambda *a: "hc")
    for name in ("_attention", "_decode_attention"):
        wrap(name, lambda index, *a: f"attn:{types[index].split('_')[0]}")
    for name in ("_moe", "_decode_moe"):
        wrap(name, lambda *a: "moe")
    # Module-level hc helpers are called from the block code: label them too.
    for name in ("collapse", "expand", "hc_mix"):
        func = getattr(v4_ops, name, None)
        if func is None:
            continue

        def labelled_func(*args: Any, __func=func, **kwargs: Any) -> Any:
            label = "hc" if counter.phases[-1] == "other" else counter.phases[-1]
            with counter.phase(label):
                return __func(*args, **kwargs)

        setattr(v4_ops, name, labelled_func)


def build(dtype: torch.dtype, context: int) -> v4.DeepseekV4Model:
    config = v4.DeepseekV4Config.from_hf(SHAPES)
    model = v4.DeepseekV4Model(config, dtype)
    state = random_state(SHAPES, seed=0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(state[name])
    model.finish_loading()
    model.allocate_cache(context)
    return model


def report(title: str, counter: OpCounter, layers: int, verbose: bool) -> dict[str, int]:
    total = sum(counter.counts.values())
    print(f"\n{title}: {total} aten ops (views excluded)")
    for phase, count in sorted(counter.counts.items(), key=lambda kv: -kv[1]):
        per = ""
        if phase == "hc":
            per = f"  ({count / (2 * layers):.0f} per site, {2 * layers} sites + the head's mix)"
        print(f"  {phase:14} {count:6}{per}")
        if verbose:
            top = ", ".join(f"{n} {c}" for n, c in counter.names[phase].most_common(12))
            print(f"      {top}")
    return {"total": total, **counter.counts}


def count(model: v4.DeepseekV4Model, counter: OpCounter, args: argparse.Namespace) -> dict[str, Any]:
    """The counts of one prefill chunk and one graphable decode step, printed and returned."""
    layers = model.config.num_layers
    ids = torch.arange(args.prompt + args.chunk) * 7919 % SHAPES["vocab_size"]
    context = model.context
    with torch.inference_mode():
        # A continuation chunk: it reads the ring and closes windows mid-chunk, as most chunks do.
        model.forward(ids[: args.prompt], 0, "none")
        counter.reset()
        with counter:
            model.forward(ids[args.prompt :], args.prompt, "last")
        chunk = report(f"prefill chunk of {args.chunk} at {args.prompt}", counter, layers, args.verbose)

        model.forward(ids[: args.prompt], 0, "none")
        token = ids[args.prompt : args.prompt + 1].clone()
        pos = torch.tensor([args.prompt])
        model.decode_graphable(token, pos, context)  # warm-up: lazily built constants
        model.set_length(args.prompt + 1)
        model.forward(ids[: args.prompt], 0, "none")
        counter.reset()
        with counter:
            model.decode_graphable(token, pos, context)
        title = f"graphable decode step at {args.prompt} (span {context})"
        step = report(title, counter, layers, args.verbose)
    return {"prefill_chunk": chunk, "decode_step": step}


# --- on a GPU: real kernels and times at the benchmark's full widths ------------------------------


def _load_module(path: str) -> Any:
    """Another version of deepseek_v4.py (a saved copy of an older one), to compare against."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("ds4desk_v4_baseline", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _flash_model(
    module: Any, context: int, seed: int, dtype: torch.dtype = torch.bfloat16, like: Any = None
) -> Any:
    """bench/gpu_deepseek_v4.py's Flash-shaped model (float32 hc / sinks / biases), random weights
    made on the GPU, or `like`'s weights cast to `dtype`."""
    from gpu_deepseek_v4 import FLASH_SHAPES

    config = module.DeepseekV4Config.from_hf(FLASH_SHAPES)
    with torch.device("meta"):
        model = module.DeepseekV4Model(config, dtype)
    model.materialize(torch.device("cuda"))
    gen = torch.Generator("cuda").manual_seed(seed)
    source = dict(like.named_parameters()) if like is not None else {}
    with torch.no_grad():
        for name, param in model.named_parameters():
            if source:
                param.copy_(source[name])
            elif name.endswith("tid2eid"):
                experts = config.num_experts
                rows = [torch.randperm(experts, device="cuda", generator=gen) for _ in range(8)]
                table = torch.stack(rows)[:, : config.experts_per_token]  # 8 distinct rows, repeated
                param.copy_(table.repeat(param.shape[0] // 8 + 1, 1)[: param.shape[0]])
            elif name.endswith(("norm.weight", "scale")):
                param.uniform_(0.5, 1.5, generator=gen)
            else:
                param.normal_(0.0, 0.5 if name.endswith(("sinks", "bias", "base")) else 0.02, generator=gen)
    model.finish_loading()
    model.allocate_cache(context)
    return model


def _cuda_kernels(run: Callable[[], Any]) -> int:
    """CUDA kernels (and memsets / copies) one call launches, from the profiler."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    return sum(1 for event in prof.events() if event.device_type == torch.autograd.DeviceType.CUDA)


def _cuda_times(model: Any, prompt: int, chunk: int, steps: int) -> dict[str, float]:
    ids = (torch.arange(prompt, device="cuda") * 7919 + 13) % 120000 + 100
    out: dict[str, float] = {}
    with torch.inference_mode():
        for length in (1024, prompt):
            for repeat in range(2):  # the first is a warm-up
                torch.cuda.synchronize()
                start = time.perf_counter()
                for first in range(0, length, chunk):
                    last = min(first + chunk, length)
                    model.forward(ids[first:last], first, "last" if last == length else "none")
                torch.cuda.synchronize()
                if repeat:
                    out[f"prefill_{length}_tok_s"] = length / (time.perf_counter() - start)
        token = ids[prompt - 1 : prompt].clone()
        pos = torch.tensor([prompt], device="cuda")
        span = model.context
        model.decode_graphable(token, pos, span)  # warm-up: constants, Triton's compile
        out["decode_kernels"] = _cuda_kernels(lambda: model.decode_graphable(token, pos, span))
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                model.decode_graphable(token, pos, span)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            model.decode_graphable(token, pos, span)
        for timed in (False, True):
            torch.cuda.synchronize()
            start = time.perf_counter()
            for step in range(steps):
                pos.fill_(prompt + step % 8)
                graph.replay()
            torch.cuda.synchronize()
            if timed:
                out["decode_graph_ms"] = 1e3 * (time.perf_counter() - start) / steps
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(10):
            model.decode_graphable(token, pos, span)
        torch.cuda.synchronize()
        out["decode_eager_ms"] = 1e3 * (time.perf_counter() - start) / 10
    return {k: round(v, 3) for k, v in out.items()}


def cuda_report(args: argparse.Namespace) -> None:
    """Kernels and times of this version (and --baseline-file's), plus their logits on equal weights."""
    print(
        f"torch {torch.__version__}, {torch.cuda.get_device_name()}, fused rms_norm kernel on CUDA: "
        f"{torch._C._dispatch_has_kernel_for_dispatch_key('aten::_fused_rms_norm', 'CUDA')}, "
        f"Triton hc kernel: {v4_hc_kernel._triton_kernel() is not None}"
    )
    context = args.cuda_prompt + 64
    versions = [("now", v4)]
    if args.baseline_file:
        versions.append(("baseline", _load_module(args.baseline_file)))
    # bf16 logits of each version against this version's float32 ones, on the same weights.
    reference = _flash_model(v4, context, seed=0, dtype=torch.float32)
    exact = _logits(reference, context)
    for name, module in versions:
        model = _flash_model(module, context, seed=0, like=reference)
        if not args.accuracy_only:
            print(name, json.dumps(_cuda_times(model, args.cuda_prompt, args.chunk, steps=50)), flush=True)
        for what, ours, ref in zip(("prefill", "decode step"), _logits(model, context), exact, strict=True):
            error = float((ours - ref).norm() / ref.norm())
            print(
                f"{name}: bf16 {what} logits vs float32: relative error {error:.2e}, argmax equal "
                f"{bool(ours.argmax() == ref.argmax())}",
                flush=True,
            )
        del model
        torch.cuda.empty_cache()


def _logits(model: Any, context: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A 299-token prefill's last logits and the next decode_graphable step's, float32."""
    with torch.inference_mode():
        ids = (torch.arange(300, device="cuda") * 7919 + 13) % 120000 + 100
        first = model.forward(ids[:299], 0, "last").float()
        step = model.decode_graphable(ids[299:300].clone(), torch.tensor([299], device="cuda"), context)
    return first, step.float()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", type=int, default=600, help="tokens before the counted decode step")
    parser.add_argument("--chunk", type=int, default=512, help="the counted prefill chunk's length")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--verbose", action="store_true", help="the most frequent ops of each phase")
    parser.add_argument("--json", action="store_true", help="also print the counts as one JSON line")
    parser.add_argument("--cuda", action="store_true", help="GPU: kernels and times at the full widths")
    parser.add_argument("--cuda-prompt", type=int, default=4096, help="--cuda: the prefill length")
    parser.add_argument("--baseline-file", help="--cuda: also time this copy of deepseek_v4.py")
    parser.add_argument("--accuracy-only", action="store_true", help="--cuda: no times")
    args = parser.parse_args()
    if args.cuda:
        cuda_report(args)
        return
    model = build(getattr(torch, args.dtype), args.prompt + args.chunk + 8)
    counter = OpCounter()
    _label_methods(model, counter)
    results = {}
    # Each fused op (hyper-connection weights and sites, decode and prefill attention, the compressor
    # step) is one custom op on CUDA + Triton and the eager ops elsewhere: count both.
    modes = ((False, "eager ops (CPU, or no Triton)"), (True, "fused ops (CUDA + Triton)"))
    for fused, what in modes:
        print(f"\n=== {what} ===")
        with launch.force({module.SWITCH: fused for module in FUSED_MODULES}):
            results["fused" if fused else "eager"] = count(model, counter, args)
    if args.json:
        print(json.dumps({"dtype": args.dtype, **results}))


if __name__ == "__main__":
    main()
