"""`ds4desk check`, the real CLI run in this process, once for each path read from stdin: one JSON
line back per path with its exit status, what it printed, and this process's peak resident memory
during that check (VmHWM, reset just before it). One process for the whole corpus, so each case
costs the check, not another start of Python and torch; the test bounds each case's time."""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import traceback

from ds4desk.cli import main as cli_main
from tests.robustness.sandbox import peak_kib, reset_peak


def main(data_dir: str) -> None:
    answers = sys.stdout
    for line in sys.stdin:
        path = line.rstrip("\n")
        out, err = io.StringIO(), io.StringIO()
        reset_peak(os.getpid())
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = cli_main(["--data-dir", data_dir, "check", path])
            except BaseException:  # what escapes the CLI is what the test looks for
                code = -1
                err.write(traceback.format_exc())
        peak = peak_kib(os.getpid())
        answers.write(
            json.dumps({"code": code, "out": out.getvalue(), "err": err.getvalue(), "peak_kib": peak})
        )
        answers.write("\n")
        answers.flush()


if __name__ == "__main__":
    main(sys.argv[1])
