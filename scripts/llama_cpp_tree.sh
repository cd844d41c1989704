#!/usr/bin/env bash
# The parts of llama.cpp's source tree the DeepSeek-V4 GGUF tests run (its HF -> GGUF converter, the
# gguf-py it imports, the chat templates it embeds), from llama-cpp-python's source distribution:
# the same llama.cpp the installed llama-cpp-python runtime is built from. Into .data/llama_cpp_tree
# (git-ignored); the tests skip without it. Usage: scripts/llama_cpp_tree.sh [PYTHON]
set -euo pipefail

VERSION=0.3.36
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PYTHON="${1:-$ROOT/.venv/bin/python}"
DEST="$ROOT/.data/llama_cpp_tree"

if [ -f "$DEST/convert_hf_to_gguf.py" ] && [ -f "$DEST/.version" ] && [ "$(cat "$DEST/.version")" = "$VERSION" ]; then
    echo "llama.cpp tree $VERSION already in $DEST"
    exit 0
fi

WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
"$PYTHON" -m pip download --quiet --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$WORK"
ARCHIVE="$(ls "$WORK"/llama_cpp_python-*.tar.gz)"
INNER="llama_cpp_python-$VERSION/vendor/llama.cpp"
tar -xzf "$ARCHIVE" -C "$WORK" \
    "$INNER/convert_hf_to_gguf.py" "$INNER/conversion" "$INNER/gguf-py" "$INNER/models/templates"
rm -rf "$DEST"
mkdir -p "$(dirname "$DEST")"
mv "$WORK/$INNER" "$DEST"
echo "$VERSION" > "$DEST/.version"
echo "llama.cpp tree $VERSION in $DEST"
