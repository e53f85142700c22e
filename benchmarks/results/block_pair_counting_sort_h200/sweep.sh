#!/usr/bin/env bash
# Counting-sort block-major against query-major at short extends and after prefixes (BLOCK_MAJOR_FROM), and pass sizes at 128K.
set -u
export M3_COMMIT=${M3_COMMIT:-wip}
R=scripts/gpu/run.sh
T0=$(date +%s)
mkdir -p $OUT/prefix $OUT/fresh $OUT/c32k $OUT/c8k
OUT=$OUT/fresh $R exec python3 benchmarks/prefill_attention_forms.py --n 1024 2048 4096 6144 8192 > $OUT/fresh/log 2>&1; echo "fresh $(( $(date +%s) - T0 )) s"
OUT=$OUT/prefix $R exec python3 benchmarks/prefill_attention_forms.py --n 1024 2048 4096 8192 --prefix 8192 16384 61440 122880 > $OUT/prefix/log 2>&1; echo "prefix $(( $(date +%s) - T0 )) s"
OUT=$OUT/c32k $R exec python3 benchmarks/prefill_attention_forms.py --n 131072 --chunk 32768 > $OUT/c32k/log 2>&1; echo "c32k $(( $(date +%s) - T0 )) s"
OUT=$OUT/c8k $R exec python3 benchmarks/prefill_attention_forms.py --n 131072 --chunk 8192 > $OUT/c8k/log 2>&1; echo "c8k $(( $(date +%s) - T0 )) s"
python3 - <<'PY'
import json, os
o = os.environ["OUT"]
for part in ("fresh", "prefix", "c32k", "c8k"):
    try:
        rows = json.load(open(f"{o}/{part}/prefill_attention_forms.json"))["rows"]
    except Exception as e:
        print(part, "missing", e); continue
    for row in rows:
        m = row["median_ms"]
        print(part, row["N"], row["prefix"], row["block_major_chunk"], round(m["query_major"], 3), round(m["block_major"], 3), row["same_blocks"], round(row["max_abs_diff"], 4))
PY
