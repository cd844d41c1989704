from collections.abc import Iterator

import pytest

from ds4desk.engine.client import EngineClient
from ds4desk.engine.engine import Engine
from tests.ui.conftest import loop, run  # noqa: F401 - the qasync loop fixtures, shared


@pytest.fixture(scope="module")
def client() -> Iterator[EngineClient]:
    """The real engine thread (one per test module), as the window's backend."""
    engine = Engine()
    yield EngineClient(engine)
    engine.close()
