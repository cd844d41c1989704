#!/usr/bin/env bash
# Adds ds4desk to the desktop's application menu for this user (double-click it, or run it once).
# It points the menu entry at this folder, so run it again after moving the folder.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
apps="${XDG_DATA_HOME:-$HOME/.local/share}/applications"
icons="${XDG_DATA_HOME:-$HOME/.local/share}/icons/hicolor/256x256/apps"
mkdir -p "$apps" "$icons"
cp "$here/ds4desk.png" "$icons/ds4desk.png"
sed -e "s|^Exec=ds4desk|Exec=\"$here/ds4desk\"|" -e "s|^Icon=ds4desk|Icon=$icons/ds4desk.png|" \
    "$here/ds4desk.desktop" >"$apps/ds4desk.desktop"
echo "installed $apps/ds4desk.desktop"
