#!/usr/bin/env bash
# A/B of the counting-sort pair grouping (working tree) against 9d119be's torch.sort grouping (tmp/old).
set -u
export M3_COMMIT=${M3_COMMIT:-wip}
R=scripts/gpu/run.sh
T0=$(date +%s)
OUT=$OUT/tests $R tests tests/kernels/test_block_pair_grouping.py tests/kernels/test_msa_gpu.py tests/kernels/test_msa_prepare.py > /dev/null 2>&1
tail -4 $OUT/tests/gpu_tests.log; echo "tests done $(( $(date +%s) - T0 )) s"
mkdir -p $OUT/new $OUT/old
OUT=$OUT/new $R exec python3 benchmarks/block_pair_grouping.py 2>&1 | tail -4
echo "grouping done $(( $(date +%s) - T0 )) s"
N="8192 16384 32768 131072"
for round in 1; do
  OUT=$OUT/new $R exec python3 benchmarks/prefill_attention_forms.py --n $N > $OUT/new/forms_$round.log 2>&1
  (cd tmp/old && OUT=$OUT/old PYTHONPATH=kernels python3 benchmarks/prefill_attention_forms.py --n $N > $OUT/old/forms_$round.log 2>&1)
  cp $OUT/new/prefill_attention_forms.json $OUT/new/forms_$round.json; cp $OUT/old/prefill_attention_forms.json $OUT/old/forms_$round.json
  echo "round $round done $(( $(date +%s) - T0 )) s"
done
python3 - <<'PY'
import json, os
o = os.environ["OUT"]
for r in (1,):
    for side in ("old", "new"):
        for row in json.load(open(f"{o}/{side}/forms_{r}.json"))["rows"] if isinstance(json.load(open(f"{o}/{side}/forms_{r}.json")), dict) else json.load(open(f"{o}/{side}/forms_{r}.json")):
            print(r, side, row["N"], row["prefix"], {k: round(v, 3) for k, v in row["median_ms"].items()}, row["same_blocks"], round(row["max_abs_diff"], 4))
PY
