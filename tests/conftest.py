"""Fixtures shared by every test folder."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Qt must never look for a display in tests; set before anything imports Qt.
os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")


@pytest.fixture(scope="session")
def ds4_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A data directory (settings, history, crash log) shared by the whole run."""
    return tmp_path_factory.mktemp("ds4-home")


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    """A fresh chat-history database path (the file does not exist yet)."""
    return tmp_path / "history.sqlite3"
