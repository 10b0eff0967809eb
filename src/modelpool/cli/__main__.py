"""``python -m modelpool.cli``: the same command as ``modelpool``."""

import sys

from modelpool.cli import main

if __name__ == "__main__":
    sys.exit(main())
