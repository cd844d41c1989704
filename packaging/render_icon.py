"""Renders ds4desk/assets/ds4desk.svg to the PNG the window and the desktop entry use.

Run it after changing the SVG: `.venv/bin/python packaging/render_icon.py` (the PNG is committed, so
neither the app nor the bundle needs Qt's SVG plugins to show the icon).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

from PySide6.QtCore import Qt
from PySide6.QtGui import QGuiApplication, QImage, QPainter
from PySide6.QtSvg import QSvgRenderer

ASSETS = Path(__file__).resolve().parent.parent / "ds4desk" / "assets"
SIZE = 256


def render(svg: Path, png: Path, size: int = SIZE) -> None:
    renderer = QSvgRenderer(str(svg))
    if not renderer.isValid():
        raise SystemExit(f"render_icon: {svg} is not a valid SVG")
    image = QImage(size, size, QImage.Format.Format_ARGB32_Premultiplied)
    image.fill(Qt.GlobalColor.transparent)
    painter = QPainter(image)
    painter.setRenderHint(QPainter.RenderHint.Antialiasing)
    renderer.render(painter)
    painter.end()
    if not image.save(str(png)):
        raise SystemExit(f"render_icon: could not write {png}")


def main() -> int:
    _app = QGuiApplication(sys.argv)
    render(ASSETS / "ds4desk.svg", ASSETS / "ds4desk.png")
    print(f"wrote {ASSETS / 'ds4desk.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
