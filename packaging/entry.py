"""The bundle's entry point: the same `ds4desk` command a source install has (ds4desk.cli:main)."""

import multiprocessing
import sys

from ds4desk.cli import main

if __name__ == "__main__":
    # ds4desk starts no processes itself, but torch may; a frozen child must not rerun main().
    multiprocessing.freeze_support()
    sys.exit(main())
