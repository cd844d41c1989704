import sys

from ds4desk.cli import main

sys.exit(main())
