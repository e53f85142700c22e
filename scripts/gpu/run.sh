#!/usr/bin/env bash
# On the lent GPU machine: real SGLang 0.5.23 (site archive) + the project's plugin from this
# working tree. Run from the repository root; the device call carries scripts/gpu/build/site.tar.xz.
#
#   scripts/gpu/run.sh check              # imports, platform, plugin and stand-in smoke check
#   scripts/gpu/run.sh tests [PYTEST...]  # tests/gpu (exactness, graphs, fused vs torch MoE), or the files named
#   scripts/gpu/run.sh bench [ARGS...]    # benchmarks/e2e_gpu.py (its output also in $OUT/bench.log)
#   scripts/gpu/run.sh exec CMD...        # any command in the harness environment
#   scripts/gpu/run.sh pack [KEEP...]      # everything under $OUT into $OUT/out.tar; KEEP files stay beside it
#   scripts/gpu/run.sh caches             # the JIT and Triton kernel caches into $OUT/gpu-caches.tar.xz
#
# Results and logs go under $OUT (the device call's output folder; ./gpu-out when unset).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
ARCHIVE="${M3_SITE_ARCHIVE:-$ROOT/scripts/gpu/build/site.tar.xz}"
SITE=/tmp/m3-gpu-site
# rebuilt at every call: commands run side by side (one per GPU) each name their own
PLUGIN="${M3_PLUGIN_DIR:-/tmp/m3-gpu-plugin}"
export OUT="${OUT:-$ROOT/gpu-out}"
mkdir -p "$OUT"

# Compiled kernels persist in the ignored build folder, so that a call can hand them back
# (`run.sh caches`) and a later call on a fresh machine carry them: SGLang's JIT kernels
# (activation, rope; nvcc, a minute or more) and Triton's (a server's start on a fresh machine took
# 135 s for ours and 217 s for upstream, against 61 s each with a warm cache). Both caches key their
# entries by source, toolchain and GPU, so a copy from another lease of the same GPU hits.
export SGLANG_JIT_CACHE_DIR="${SGLANG_JIT_CACHE_DIR:-$ROOT/scripts/gpu/build/jit-cache}"
export TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-$ROOT/scripts/gpu/build/triton-cache}"
# The caches travel best as the archive `run.sh caches` writes: 6 MB against 95 MB of folders
# (Triton keeps every kernel's IR beside its binary), where the carry holds 64 MiB in all. A
# carried scripts/gpu/build/gpu-caches.tar.xz is unpacked into the cache folders at every call;
# entries already there are kept.
CACHES_ARCHIVE="$ROOT/scripts/gpu/build/gpu-caches.tar.xz"
if [[ -f "$CACHES_ARCHIVE" ]]; then
    tar xJf "$CACHES_ARCHIVE" -C "$ROOT/scripts/gpu/build" --skip-old-files
fi

if [[ "${1:-}" == pack ]]; then
    shift
    # The device hands back at most eight files from $OUT, two folders down, named in letters,
    # digits, '.', '_' and '-' only (a tuned table's name has '=' and ','): one archive carries
    # everything, and the files named as arguments (paths under $OUT) come back beside it too.
    cd "$OUT"
    # A file over the device's 16 MiB per returned file never comes back, and one such member
    # makes out.tar itself too large to come back: a session lost a whole call's results to the
    # kernel-cache archive of a tuning run packed with them. Files over M3_PACK_MAX_MB (8) stay out of
    # out.tar, named on stderr (a file named to keep stays beside it, on its own).
    max_mb="${M3_PACK_MAX_MB:-8}"
    too_large=$(find . -type f ! -name out.tar -size +"${max_mb}"M -printf '%P\n')
    for file in $too_large; do echo "pack: left out of out.tar (over ${max_mb} MiB): $file" >&2; done
    # appended, so packing twice keeps what the first pack took in
    [[ -f out.tar ]] || tar cf out.tar --files-from /dev/null
    tar rf out.tar --exclude=./out.tar $(printf -- '--exclude=./%s ' $too_large) .
    find . -type f ! -name out.tar -print0 | while IFS= read -r -d '' file; do
        keep=0
        for wanted in "$@"; do [[ "${file#./}" == "${wanted#./}" ]] && keep=1; done
        (( keep )) || rm -f -- "$file"
    done
    find . -mindepth 1 -type d -empty -delete
    echo "packed $(tar tf out.tar | grep -vc '/$') files into $OUT/out.tar; kept beside it: ${*:-none}"
    (( $(stat -c %s out.tar) <= 16 * 1024 * 1024 )) || echo "pack: out.tar is over the 16 MiB a device call hands back: it will not come back" >&2
    exit 0
fi

if [[ "${1:-}" == caches ]]; then
    # Copy it to scripts/gpu/build/gpu-caches.tar.xz here and name that file in the next call's
    # carry (see CACHES_ARCHIVE above); the archive holds the folders relative to the build folder.
    members=()
    for cache in "$SGLANG_JIT_CACHE_DIR" "$TRITON_CACHE_DIR"; do
        [[ -d "$cache" ]] && members+=(-C "$(dirname "$cache")" "$(basename "$cache")")
    done
    (( ${#members[@]} )) || { echo "no kernel cache at $SGLANG_JIT_CACHE_DIR or $TRITON_CACHE_DIR yet: start a server or run a test first" >&2; exit 2; }
    tar cf - "${members[@]}" | xz -T0 -6 > "$OUT/gpu-caches.tar.xz"
    echo "kernel caches: $OUT/gpu-caches.tar.xz ($(du -h "$OUT/gpu-caches.tar.xz" | cut -f1))"
    # a tuning run compiles hundreds of candidate kernels: its caches outgrow what comes back
    (( $(stat -c %s "$OUT/gpu-caches.tar.xz") <= 16 * 1024 * 1024 )) \
        || echo "caches: the archive is over the 16 MiB a device call hands back: it will not come back (pack leaves it out of out.tar)" >&2
    exit 0
fi

# Lanes started side by side (one per GPU) share the unpacked site: the first unpacks it while the
# others wait on the lock (two unpacking at once failed one lane's tar with "Cannot mkdir").
(
    flock 9
    if [[ ! -f "$SITE/.unpacked" ]]; then
        [[ -f "$ARCHIVE" ]] || { echo "no site archive at $ARCHIVE: run scripts/gpu/build_site.sh and carry it" >&2; exit 2; }
        rm -rf "$SITE" && mkdir -p "$SITE"
        tar xJf "$ARCHIVE" -C "$SITE"
        touch "$SITE/.unpacked"
    fi
) 9>"$SITE.lock"

# The project's model plugin as an installed distribution would expose it: its dist-info with the
# entry points of pyproject.toml, the packages straight from the working tree (no copy, no build).
rm -rf "$PLUGIN" && mkdir -p "$PLUGIN"
python3 - "$ROOT/pyproject.toml" "$PLUGIN" <<'PYEOF'
import sys, tomllib
from pathlib import Path
project = tomllib.loads(Path(sys.argv[1]).read_text())["project"]
info = Path(sys.argv[2]) / f"{project['name'].replace('-', '_')}-{project['version']}.dist-info"
info.mkdir(parents=True)
(info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project['version']}\n")
lines = []
for group, entries in project.get("entry-points", {}).items():
    lines.append(f"[{group}]")
    lines += [f"{name} = {target}" for name, target in entries.items()]
(info / "entry_points.txt").write_text("\n".join(lines) + "\n")
(info / "RECORD").write_text("")
PYEOF

# The stand-ins from the working tree come first (edits need no archive rebuild); the archive
# holds the same packages and the platform's dist-info (its entry point).
export PYTHONPATH="$ROOT/scripts/gpu/standins:$SITE:$ROOT:$ROOT/kernels:$PLUGIN${PYTHONPATH:+:$PYTHONPATH}"
export M3_GPU_PLUGIN_DIR="$PLUGIN"
export SGLANG_PLATFORM="${SGLANG_PLATFORM:-m3_gpu_harness}"
export SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK=1
export SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND=python
export M3_GPU_STANDIN_LOG="$OUT/standin_ops.txt"
# SGLang's norm, activation and rotary layers on their CUDA forwards (the platform's default),
# exported so that every result's recorded switches name it; 0 keeps their native forwards.
export M3_HARNESS_CUDA_CUSTOM_OPS="${M3_HARNESS_CUDA_CUSTOM_OPS:-1}"
export PYTHONUNBUFFERED=1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
# Keep NVLink multicast off on multi-GPU machines (the workplace's rule).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
cd "$ROOT"

step="${1:-check}"
shift || true
if [[ -z "${M3_COMMIT:-}" && "$step" != check ]]; then
    # The device's copy of the tree may carry a stale .git: its HEAD is not the commit that runs.
    echo "run.sh: M3_COMMIT is not set; results will name this copy's git HEAD ($(git rev-parse --short HEAD 2>/dev/null || echo none)), which may be stale: pass the commit literally" >&2
fi
case "$step" in
    check)
        python3 - <<'PYEOF'
import importlib.metadata as md, torch, sglang, transformers
from sglang.srt.platforms import current_platform
print("torch", torch.__version__, "cuda", torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "-")
print("sglang", sglang.__version__, "transformers", transformers.__version__)
print("platform", type(current_platform).__name__, current_platform.device_type)
print("plugins", sorted(e.name for e in md.entry_points(group="sglang.srt.plugins")))
print("platforms", sorted(e.name for e in md.entry_points(group="sglang.srt.platforms")))
import sgl_kernel
print("sgl_kernel stand-in", getattr(sgl_kernel, "__sgl_kernel_standin__", False))
PYEOF
        ;;
    tests)
        set -o pipefail
        # tests/gpu unless the arguments name test files or folders themselves (options alone keep it)
        targets=(tests/gpu)
        for arg in "$@"; do
            if [[ "$arg" != -* && -e "${arg%%::*}" ]]; then targets=(); break; fi
        done
        python3 -m pytest "${targets[@]}" -v -s -p no:cacheprovider --junitxml="$OUT/gpu_tests.xml" "$@" 2>&1 | tee "$OUT/gpu_tests.log"
        ;;
    bench)
        # Its progress (every figure as it is measured) also lands in $OUT/bench.log, appended, so
        # a run cut short or a result file lost on the way back still leaves the numbers.
        python3 benchmarks/e2e_gpu.py --out "$OUT" "$@" 2>&1 | tee -a "$OUT/bench.log"
        ;;
    exec)
        "$@"
        ;;
    *)
        echo "unknown step $step (check | tests | bench | exec | pack)" >&2
        exit 2
        ;;
esac
