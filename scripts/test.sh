#!/usr/bin/env bash
# Sets up .venv (scripts/setup.sh) and runs the whole test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Imports write their bytecode cache (scripts/setup.sh says why); the tests' servers need it.
unset PYTHONDONTWRITEBYTECODE
exec .venv/bin/python -m pytest "$@"
