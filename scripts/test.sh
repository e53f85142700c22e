#!/usr/bin/env bash
# Sets up .venv (scripts/setup.sh) and runs the whole test suite. Extra arguments go to pytest.
# Two pytest-xdist workers (M3_TEST_WORKERS; 0 runs in one process): most tests keep one core busy
# (the Triton interpreter, hypothesis, an HTTP client waiting on a server), so a second worker on the
# other core nearly halves the run. tests/conftest.py keeps the server tests together in one worker.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Imports write their bytecode cache (scripts/setup.sh says why); the tests' servers need it.
unset PYTHONDONTWRITEBYTECODE
# One OpenMP thread per process: the two workers and the servers they start share 2 cores, and
# torch's spinning OpenMP threads, more of them than cores, slowed one server module 6x (a module of
# 80 s alone took 510 s beside the other worker). The tests' tensors are small; a thread each is enough.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec .venv/bin/python -m pytest -n "${M3_TEST_WORKERS:-2}" --dist loadgroup "$@"
