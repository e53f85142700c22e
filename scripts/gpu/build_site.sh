#!/usr/bin/env bash
# Build the GPU harness's site archive: SGLang 0.5.23's pure-Python parts and the wheels the
# lent GPU lacks (site.lock), plus the harness's sgl_kernel stand-in and CUDA platform.
#
#   scripts/gpu/build_site.sh [--relock]
#
# Output: scripts/gpu/build/site.tar.xz (ignored by git; name it in the device call's carry).
# Wheels are cached in scripts/gpu/build/wheels, so a rebuild downloads nothing new.
# --relock rewrites site.lock from site.in against the project's .venv first (lock_site.py).
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
BUILD="$HERE/build"
WHEELS="$BUILD/wheels"
SITE="$BUILD/site"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
SGLANG_VERSION=0.5.23

if [[ "${1:-}" == "--relock" ]]; then
    "$PY" "$HERE/lock_site.py"
fi

mkdir -p "$WHEELS"
mapfile -t REQS < <(grep -v '^#' "$HERE/site.lock" | sed '/^$/d')
REQS+=("sglang==$SGLANG_VERSION")
STAMP="$WHEELS/.lock-$(cat "$HERE/site.lock" | sha256sum | cut -c1-16)"
if [[ ! -f "$STAMP" ]]; then
    # One wheel per pinned name, CPython 3.12 on manylinux x86_64 (the device), no dependencies
    # resolved here: site.lock is the closure.
    PLATFORMS=()
    for tag in manylinux_2_39 manylinux_2_35 manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 \
               manylinux_2_24 manylinux_2_17 manylinux2014 manylinux1; do
        PLATFORMS+=(--platform "${tag}_x86_64")
    done
    # setup.sh's venv (made by uv) has no pip; any Python with pip can download wheels for another.
    PIP_PY="$PY"
    "$PIP_PY" -m pip --version >/dev/null 2>&1 || PIP_PY=python3
    "$PIP_PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --abi cp312 --abi abi3 --abi none "${PLATFORMS[@]}" --platform any -d "$WHEELS" "${REQS[@]}"
    touch "$STAMP"
fi

rm -rf "$SITE"
mkdir -p "$SITE"
"$PY" - "$WHEELS" "$SITE" "${REQS[@]}" <<'PYEOF'
import re, sys, zipfile
from pathlib import Path
wheels, site, reqs = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:]
norm = lambda s: re.sub(r"[-_.]+", "_", s).lower()
by_name = {}
for whl in wheels.glob("*.whl"):
    name, version = whl.name.split("-")[:2]
    by_name.setdefault((norm(name), version), whl)
for req in reqs:
    name, version = req.split("==")
    whl = by_name.get((norm(name), version))
    if whl is None:
        sys.exit(f"no cached wheel for {req} in {wheels}")
    zipfile.ZipFile(whl).extractall(site)
print(f"unpacked {len(reqs)} wheels")
PYEOF

# SGLang's compiled Rust extensions were built for another torch/Python; the harness runs the
# Python radix tree (SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND=python). Tests and caches are dead weight.
find "$SITE/sglang" -name '*.so' -path '*rust*' -delete
find "$SITE" -name '__pycache__' -type d -prune -exec rm -rf {} +
rm -rf "$SITE/sglang/multimodal_gen"  # diffusion serving: never imported by the LLM server

# The stand-ins, and the platform's entry point (SGLang discovers platforms through dist-info).
cp -r "$HERE/standins/sgl_kernel" "$HERE/standins/m3_gpu_harness" "$HERE/standins/av" "$HERE/standins/flash_mla" "$SITE/"
DI="$SITE/m3_gpu_harness-0.0.0.dist-info"
mkdir -p "$DI"
printf 'Metadata-Version: 2.1\nName: m3-gpu-harness\nVersion: 0.0.0\nSummary: sglang-m3 GPU harness platform (test infrastructure)\n' >"$DI/METADATA"
printf '[sglang.srt.platforms]\nm3_gpu_harness = m3_gpu_harness:activate\n' >"$DI/entry_points.txt"
printf 'm3_gpu_harness\n' >"$DI/top_level.txt"
: >"$DI/RECORD"

(cd "$BUILD" && tar cJf site.tar.xz.tmp -C "$SITE" . && mv site.tar.xz.tmp site.tar.xz)
echo "site archive: $BUILD/site.tar.xz ($(du -h "$BUILD/site.tar.xz" | cut -f1))"
