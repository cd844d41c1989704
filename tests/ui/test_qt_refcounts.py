"""PySide6 6.12.0 on Python 3.11 drops a reference to None on calls such as QLabel.setText and to
True/False on Signal.emit; after a few thousand calls the interpreter aborts (none_dealloc). A
long chat session makes far more calls than that, so the installed Qt binding must not do it."""

from __future__ import annotations

import os
import subprocess
import sys

SCRIPT = """
import sys
from PySide6.QtCore import QObject, Signal
from PySide6.QtWidgets import QApplication, QLabel

class Emitter(QObject):
    fired = Signal(bool)

app = QApplication([])
label = QLabel()
emitter = Emitter()
emitter.fired.connect(lambda _value: None)
before = (sys.getrefcount(None), sys.getrefcount(True))
for _ in range(50_000):
    label.setText("x")
    emitter.fired.emit(True)
after = (sys.getrefcount(None), sys.getrefcount(True))
print(after[0] - before[0], after[1] - before[1])
"""


def test_qt_calls_keep_none_and_true_alive() -> None:
    env = {**os.environ, "QT_QPA_PLATFORM": "offscreen"}
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    none_drift, true_drift = map(int, done.stdout.split())
    # A few references may come and go with caches; 50,000 lost ones may not.
    assert abs(none_drift) < 1000 and abs(true_drift) < 1000
