"""``python -m m3_operator``: the same command line as ``sglang-m3 operator``."""

import sys

from m3_operator.cli import main

if __name__ == "__main__":
    sys.exit(main())
