"""The test loop behaves like the app's: a task keeps streaming while the test acts between runs."""

from __future__ import annotations

import asyncio
import time

import qasync
from PySide6.QtWidgets import QApplication


def test_a_task_stepped_between_runs_finds_a_running_loop(
    qapp: QApplication, loop: qasync.QEventLoop
) -> None:
    steps: list[int] = []

    async def stream() -> None:
        for step in range(50):
            await asyncio.sleep(0.001)
            steps.append(step)

    task = loop.create_task(stream())

    async def first_steps() -> None:
        while len(steps) < 3:
            await asyncio.sleep(0.001)

    loop.run_until_complete(first_steps())
    # Between runs, Qt delivers events on its own (qtbot's clicks, qasync's last processEvents); the
    # stream's due timer steps the task here, outside run_until_complete (a pass sets the sleep's
    # future, the next steps the task).
    time.sleep(0.01)
    for _ in range(3):
        qapp.processEvents()
    loop.run_until_complete(asyncio.wait_for(asyncio.shield(task), timeout=10))
    assert task.exception() is None
    assert steps == list(range(50))
