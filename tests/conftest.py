"""Fixtures shared by every test folder."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Qt must never look for a display in tests; set before anything imports Qt.
os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

from ds4desk.paths import resolve_data_dirs


@pytest.fixture(scope="session")
def ds4_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A data directory shared by the whole run, so the embedded GGUF is imported only once."""
    return tmp_path_factory.mktemp("ds4-home")


@pytest.fixture(scope="session")
def model_cache(ds4_home: Path) -> Path:
    return resolve_data_dirs(ds4_home).create().model_cache


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    """A fresh chat-history database path (the file does not exist yet)."""
    return tmp_path / "history.sqlite3"
