"""Make the operator test harness importable (pytest runs with --import-mode=importlib) and
provide its fixtures."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from m3_operator_harness import api, client, kmock_options  # noqa: E402,F401
