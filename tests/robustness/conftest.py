from tests.ui.conftest import loop, make_window, run  # noqa: F401 - the qasync loop and window fixtures, shared
