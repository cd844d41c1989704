#!/usr/bin/env bash
# Builds the one-folder bundle dist/ds4desk/ from the checkout's .venv (scripts/setup.sh makes it).
# The bundle gets the torch that venv has: CPU here; see README "Bundles" for CUDA and ROCm.
#   bash packaging/build.sh            build (PyInstaller is installed into .venv if missing)
#   PYTHON=/path/to/python bash packaging/build.sh   build from another environment
set -euo pipefail
cd "$(dirname "$0")/.."

PYINSTALLER_VERSION=6.22.3
PYTHON="${PYTHON:-.venv/bin/python}"

if [[ ! -x "$PYTHON" ]]; then
    echo "build.sh: $PYTHON not found; run scripts/setup.sh first" >&2
    exit 1
fi
if ! "$PYTHON" -c "import PyInstaller, sys; sys.exit(PyInstaller.__version__ != '$PYINSTALLER_VERSION')" 2>/dev/null; then
    "$PYTHON" -m pip install -q "pyinstaller==$PYINSTALLER_VERSION"
fi
# The icon PNG is committed; render it again only when the SVG is newer.
if [[ ds4desk/assets/ds4desk.svg -nt ds4desk/assets/ds4desk.png ]]; then
    "$PYTHON" packaging/render_icon.py
fi

"$PYTHON" -m PyInstaller --noconfirm --clean --log-level WARN \
    --distpath dist --workpath build/pyinstaller packaging/ds4desk.spec
echo "build.sh: built dist/ds4desk ($(du -sh dist/ds4desk | cut -f1))"
