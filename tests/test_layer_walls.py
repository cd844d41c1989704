"""The walls of ARCHITECTURE.md: the engine never imports Qt, the UI never imports torch."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "ds4desk"
QT = ("PySide6", "qasync", "pyqtgraph", "ds4desk.ui", "ds4desk.app")
TORCH = (
    "torch",
    "ds4desk.engine.runtime",
    "ds4desk.engine.models",
    "ds4desk.engine.sampling",
    "ds4desk.engine.devices",
    "ds4desk.engine.loading",
)


def imported_modules(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def offenders(folder: Path, banned: tuple[str, ...]) -> list[str]:
    found = []
    for path in sorted(folder.rglob("*.py")):
        for name in imported_modules(path):
            if any(name == b or name.startswith(b + ".") for b in banned):
                found.append(f"{path.relative_to(PACKAGE)} imports {name}")
    return found


def test_engine_never_imports_qt() -> None:
    assert offenders(PACKAGE / "engine", QT) == []


def test_ui_never_imports_torch() -> None:
    assert offenders(PACKAGE / "ui", TORCH) == []


def test_app_core_never_imports_qt() -> None:
    core = [p for p in PACKAGE.glob("*.py") if p.name != "app.py"]
    found = [
        f"{p.name} imports {n}"
        for p in core
        for n in imported_modules(p)
        if any(n == b or n.startswith(b + ".") for b in ("PySide6", "qasync", "ds4desk.ui"))
    ]
    # cli.py opens the window through a lazy `from ds4desk.app import run_app`, which is allowed.
    assert found == []


def test_public_faces_load_without_torch() -> None:
    """Importing the engine's public face and the UI must not drag torch in (the window shows first)."""
    code = "import sys, ds4desk.engine, ds4desk.ui.main_window, ds4desk.app; print('torch' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={"QT_QPA_PLATFORM": "offscreen", "PATH": "/usr/bin:/bin"},
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
