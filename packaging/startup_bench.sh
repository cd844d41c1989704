#!/usr/bin/env bash
# Start-up time to a visible window: the bundle (dist/ds4desk) against the source install (.venv),
# alternating, each launch with an empty environment and a fresh data directory, under Xvfb.
#   bash packaging/startup_bench.sh [REPEATS]     (default 5; build the bundle first)
# Prints the medians and writes bench/results/bundle_startup_<UTC stamp>.json.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO="$(pwd)"

if [[ "${1:-}" == "--inside" ]]; then # one launch, inside xvfb-run: prints the seconds to visible
    home=$(mktemp -d)
    trap 'rm -rf "$home"' EXIT
    start=$(date +%s.%N)
    env -i HOME="$home" PATH=/usr/bin:/bin LANG=C.UTF-8 DISPLAY="$DISPLAY" XAUTHORITY="${XAUTHORITY:-}" \
        DS4DESK_REPORT_VISIBLE=1 "$2" --data-dir "$home/data" 2>"$home/err" >/dev/null &
    pid=$!
    visible=""
    for _ in $(seq 1 2400); do # 120 s at most
        visible=$(sed -n 's/^ds4desk: window visible at \([0-9.]*\)$/\1/p' "$home/err" | head -n 1)
        [[ -n "$visible" ]] && break
        kill -0 "$pid" 2>/dev/null || { cat "$home/err" >&2; exit 1; }
        sleep 0.05
    done
    kill -INT "$pid" 2>/dev/null || true
    wait "$pid" || true
    [[ -n "$visible" ]] || { echo "startup_bench: $2 never showed its window" >&2; exit 1; }
    python3 -c 'import sys; print(f"{float(sys.argv[1]) - float(sys.argv[2]):.3f}")' "$visible" "$start"
    exit 0
fi

repeats="${1:-5}"
[[ -x dist/ds4desk/ds4desk ]] || { echo "startup_bench: build the bundle first (packaging/build.sh)" >&2; exit 1; }
bundle_times=() source_times=()
for ((i = 0; i < repeats; i++)); do
    bundle_times+=("$(xvfb-run -a -s "-screen 0 1280x800x24" bash "$0" --inside "$REPO/dist/ds4desk/ds4desk")")
    source_times+=("$(xvfb-run -a -s "-screen 0 1280x800x24" bash "$0" --inside "$REPO/.venv/bin/ds4desk")")
done
mkdir -p bench/results
out="bench/results/bundle_startup_$(date -u +%Y%m%dT%H%M%SZ).json"
python3 - "$out" "$(du -sb dist/ds4desk | cut -f1)" "${bundle_times[*]}" "${source_times[*]}" <<'EOF'
import json, statistics, sys
out, size, bundle, source = sys.argv[1], int(sys.argv[2]), sys.argv[3].split(), sys.argv[4].split()
result = {
    "what": "seconds from launch to the window visible (DS4DESK_REPORT_VISIBLE), Xvfb, fresh data dir",
    "bundle_bytes": size,
    "bundle_s": [float(t) for t in bundle],
    "source_s": [float(t) for t in source],
    "bundle_median_s": statistics.median(float(t) for t in bundle),
    "source_median_s": statistics.median(float(t) for t in source),
}
with open(out, "w") as handle:
    json.dump(result, handle, indent=2)
print(f"startup_bench: bundle {result['bundle_median_s']:.2f} s, source install {result['source_median_s']:.2f} s "
      f"(medians of {len(bundle)}); bundle {size / 1e6:.0f} MB; {out}")
EOF
