from tests.ui.conftest import loop, run  # noqa: F401 - the qasync loop fixtures, shared
