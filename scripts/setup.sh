#!/usr/bin/env bash
# Creates .venv at the repository root with SGLang 0.5.23 for the CPU and this project (editable).
#
# SGLang is installed with --no-deps on purpose: its declared dependencies include several GB of
# CUDA-only wheels that a CPU machine never imports. requirements/sglang-cpu.txt lists what its
# CPU serving path does import; every other requirements/*.txt belongs to one area of the project.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=(.venv/bin/python -m pip --disable-pip-version-check -q)
log() { printf '[setup] %s\n' "$*"; }
quiet() { "$@" 2>&1 | { grep -v -E "^WARNING: Location|^ERROR: pip's dependency resolver|requires .*, which is not installed|which is incompatible" || true; }; return "${PIPESTATUS[0]}"; }
log "SGLang CPU runtime dependencies (torch from the local wheel cache where present)"
quiet "${PIP[@]}" install -r requirements/sglang-cpu.txt
log "sglang==0.5.23 without its CUDA dependency set"
quiet "${PIP[@]}" install --no-deps sglang==0.5.23
for req in requirements/*.txt; do
  [ "$req" = requirements/sglang-cpu.txt ] && continue
  log "$(basename "$req" .txt) requirements"
  quiet "${PIP[@]}" install -r "$req"
done
log "sglang-m3 (editable)"
quiet "${PIP[@]}" install --no-deps --no-build-isolation -e .
# Its CPU platform's entry point is a second distribution (metadata only; see its pyproject.toml),
# so that selecting another SGLANG_PLATFORM does not make SGLang skip the model plugin.
log "sglang-m3-cpu-platform (the CPU platform's entry point)"
quiet "${PIP[@]}" install --no-deps --no-build-isolation ./dists/sglang-m3-cpu-platform
.venv/bin/python -c "import sglang, sglang_m3, msa_kernels; print('[setup] ready: sglang', sglang.__version__)"
