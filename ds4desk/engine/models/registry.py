"""Which architectures ds4desk runs, and the family package that runs each.

Torch-free, so detection, `check` and the window can ask cheaply; `build_model` imports the family's
package (and torch) only when a model is built. A new family is a package under `models/` whose
`model.py` has `build(config, family, dtype, quantized, packed) -> CausalLM`, plus its lines here.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ds4desk.engine.api import EngineFailure, ErrorCode

if TYPE_CHECKING:
    import torch

    from ds4desk.engine.models.base import CausalLM

# config.json's architectures[0] -> (our family name, the package under models/ that runs it).
ARCHITECTURES: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("llama", "llama"),
    "MistralForCausalLM": ("mistral", "llama"),
    "Qwen2ForCausalLM": ("qwen2", "llama"),
    "Qwen3ForCausalLM": ("qwen3", "llama"),
    "DeepseekV4ForCausalLM": ("deepseek_v4", "deepseek_v4"),
    "Gemma3ForCausalLM": ("gemma3", "gemma3"),
    "Qwen3_5ForCausalLM": ("qwen3_5", "qwen3_5"),
    "Qwen3_5ForConditionalGeneration": ("qwen3_5", "qwen3_5"),  # its text model only
    "Qwen3_5MoeForCausalLM": ("qwen3_5", "qwen3_5"),  # the MoE variant: same family, sparse MLPs
    "Qwen3_5MoeForConditionalGeneration": ("qwen3_5", "qwen3_5"),  # its text model only
}


def family_for(architecture: str) -> str:
    """Our family name for a config's architectures[0]; LOAD_FAILED when we don't run it."""
    entry = ARCHITECTURES.get(architecture)
    if entry is None:
        known = ", ".join(ARCHITECTURES)
        raise EngineFailure(
            ErrorCode.LOAD_FAILED, f"unknown architecture '{architecture}'; ds4desk runs: {known}"
        )
    return entry[0]


def families_of(package: str) -> dict[str, str]:
    """architecture -> family for the architectures `package` runs."""
    return {arch: family for arch, (family, pkg) in ARCHITECTURES.items() if pkg == package}


def build_model(
    architecture: str,
    config: dict[str, Any],
    dtype: torch.dtype,
    quantized: bool = False,
    packed: Mapping[str, int] | None = None,
) -> CausalLM:
    """`architecture`'s model for `config` on the meta device: shapes and dtypes, no memory.
    `quantized`: keep the checkpoint's FP8 / FP4 weights packed (families that can). `packed`: the
    weights (parameter name -> GGML type id) to keep in their GGUF block type (models/packed.py)."""
    import torch

    family = family_for(architecture)
    module = importlib.import_module(f"ds4desk.engine.models.{ARCHITECTURES[architecture][1]}.model")
    with torch.device("meta"):
        return module.build(config, family, dtype, quantized, packed or {})
