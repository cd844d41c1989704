"""Where ds4desk keeps settings, history, caches and the crash log."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import platformdirs

ENV_HOME = "DS4DESK_HOME"


@dataclass(slots=True, frozen=True)
class DataDirs:
    config: Path
    data: Path
    cache: Path

    @property
    def settings_file(self) -> Path:
        return self.config / "settings.json"

    @property
    def history_db(self) -> Path:
        return self.data / "history.sqlite3"

    @property
    def crash_log(self) -> Path:
        return self.data / "crash.log"

    def create(self) -> DataDirs:
        for folder in (self.config, self.data, self.cache):
            folder.mkdir(parents=True, exist_ok=True)
        return self


def resolve_data_dirs(data_dir: str | os.PathLike[str] | None = None) -> DataDirs:
    """--data-dir wins, then $DS4DESK_HOME, then the platform's user directories."""
    root = data_dir or os.environ.get(ENV_HOME)
    if root:
        base = Path(root).expanduser().resolve()
        return DataDirs(config=base, data=base, cache=base / "cache")
    return DataDirs(
        config=Path(platformdirs.user_config_dir("ds4desk")),
        data=Path(platformdirs.user_data_dir("ds4desk")),
        cache=Path(platformdirs.user_cache_dir("ds4desk")),
    )
