"""One real `ds4desk serve` (uvicorn in this process, the embedded SmolLM2 on the CPU) for every
remote test that needs a server nobody scripted, and the Engine behind it for the local answers."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from ds4desk.engine.api import LoadRequest
from ds4desk.engine.engine import Engine
from ds4desk.remote import RemoteConfig, RemoteEngine
from ds4desk.server.run import ServeOptions
from tests.server.conftest import Served
from tests.server.inprocess import serving_in_process
from tests.ui.conftest import loop, make_window, run  # noqa: F401 - the real window, for test_window_remote

KEY = "remote-test-key"
MESSAGES = [{"role": "user", "content": "Name three colours of the rainbow."}]


@pytest.fixture(scope="session")
def served() -> Iterator[tuple[Served, Engine]]:
    with serving_in_process(LoadRequest(device="cpu", context=1024), ServeOptions(api_key=KEY)) as pair:
        yield pair


@pytest.fixture
def remote(served: tuple[Served, Engine]) -> Iterator[RemoteEngine]:
    engine = RemoteEngine(RemoteConfig(served[0].root, api_key=KEY))  # no /v1: it is added
    yield engine
    engine.close()
