"""The remote package keeps the engine/UI wall: its engine side imports no Qt, nothing in it imports
torch or the local engine's torch modules, and importing it (dialog included) loads no torch."""

from __future__ import annotations

from tests.test_layer_walls import PACKAGE, QT, TORCH, imported_modules, torch_loaded_after

REMOTE = PACKAGE / "remote"


def test_only_the_dialog_imports_qt() -> None:
    found = [
        f"{path.name} imports {name}"
        for path in sorted(REMOTE.glob("*.py"))
        if path.name != "connect_dialog.py"
        for name in imported_modules(path)
        if any(name == b or name.startswith(b + ".") for b in QT)
    ]
    assert found == []


def test_nothing_remote_imports_torch() -> None:
    found = [
        f"{path.name} imports {name}"
        for path in sorted(REMOTE.glob("*.py"))
        for name in imported_modules(path)
        if any(name == b or name.startswith(b + ".") for b in (*TORCH, "ds4desk.engine.engine"))
    ]
    assert found == []


def test_importing_the_remote_package_and_dialog_loads_no_torch() -> None:
    assert not torch_loaded_after("ds4desk.remote", "ds4desk.remote.connect_dialog")
