#!/usr/bin/env bash
# Creates .venv at the repository root with SGLang 0.5.23 for the CPU and this project (editable).
#
# SGLang is installed with --no-deps on purpose: its declared dependencies include several GB of
# CUDA-only wheels that a CPU machine never imports. requirements/sglang-cpu.txt lists what its
# CPU serving path does import; every other requirements/*.txt belongs to one area of the project.
#
# Packages go in with uv, not pip: torch's PyPI build (the one torchvision's wheels load beside)
# brings about 5 GB of CUDA libraries, and pip's single-threaded unpacking took over an hour of a
# 2-core CI machine's 90 minutes; uv unpacks in parallel. Nothing is byte-compiled up front (that
# took as long again, for thousands of modules never imported); instead imports write their
# bytecode cache, even where PYTHONDONTWRITEBYTECODE is set: without a cache, one `import sglang`
# took 3.5 CPU-minutes on a 2-core machine. The first process to import a module writes its cache
# (in the tests: the pytest process, then the warm interpreter the test servers fork from), so the
# closing check reads installed metadata rather than importing SGLang once more.
# Wheel folders already on the machine (pip's find-links there) are offered to uv beside PyPI.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
unset PYTHONDONTWRITEBYTECODE
log() { printf '[setup] %s (%ss)\n' "$*" "$SECONDS"; }
# Without pip inside (ensurepip alone took 4.5 minutes here): the system's pip puts uv in it.
[ -x .venv/bin/python ] || "$PY" -m venv --without-pip .venv
if [ ! -x .venv/bin/uv ]; then
  log "uv (the installer)"
  "$PY" -m pip --python .venv/bin/python --disable-pip-version-check -q install uv 2>&1 \
    | { grep -v "^WARNING: Location" || true; }
fi
UV=(.venv/bin/uv pip install --python .venv/bin/python --quiet)
for folder in /opt/pypi-more/files /opt/pypi/files /opt/wheels; do
  [ -d "$folder" ] && UV+=(--find-links "$folder")
done
log "SGLang CPU runtime dependencies (torch and torchvision, transformers, ...)"
"${UV[@]}" -r requirements/sglang-cpu.txt
log "sglang==0.5.23 without its CUDA dependency set"
"${UV[@]}" --no-deps sglang==0.5.23
for req in requirements/*.txt; do
  [ "$req" = requirements/sglang-cpu.txt ] && continue
  log "$(basename "$req" .txt) requirements"
  "${UV[@]}" -r "$req"
done
log "sglang-m3 (editable)"
"${UV[@]}" setuptools
"${UV[@]}" --no-deps --no-build-isolation -e .
# Its CPU platform's entry point is a second distribution (metadata only; see its pyproject.toml),
# so that selecting another SGLANG_PLATFORM does not make SGLang skip the model plugin.
log "sglang-m3-cpu-platform (the CPU platform's entry point)"
"${UV[@]}" --no-deps --no-build-isolation ./dists/sglang-m3-cpu-platform
.venv/bin/python - <<'CHECK'
from importlib.metadata import entry_points, version

plugins = {entry.value for entry in entry_points(group="sglang.srt.plugins")}
assert "sglang_m3.plugin:register" in plugins, f"the sglang-m3 plugin entry point is missing: {sorted(plugins)}"
print("[setup] ready: sglang", version("sglang"), "with sglang-m3", version("sglang-m3"))
CHECK
log "done"
