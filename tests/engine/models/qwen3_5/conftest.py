"""Qwen3.5's tests run their tiny models on one CPU thread: the chunked delta rule is many small
ops, and on a shared, busy machine a second thread mostly waits for its turn (a hundredfold
slowdown measured), while the results are the same."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
