#!/usr/bin/env bash
# device call 2: first 32K prompt at TP2, cuDNN chunk plans on (default) and off
export M3_COMMIT=3a94a52
TOP=$OUT
mkdir -p /tmp/pyspy && xz -dc scripts/gpu/build/py-spy.xz > /tmp/pyspy/py-spy && chmod +x /tmp/pyspy/py-spy
OUT=$TOP/check scripts/gpu/run.sh check > $TOP/check.log 2>&1 || tail -30 $TOP/check.log
timeout -s INT 240 scripts/gpu/run.sh exec python benchmarks/first_prompt_profile.py --out $TOP/plans --py-spy /tmp/pyspy/py-spy --tp 2 > $TOP/first_plans.log 2>&1
timeout -s INT 230 scripts/gpu/run.sh exec python benchmarks/first_prompt_profile.py --out $TOP/noplans --py-spy /tmp/pyspy/py-spy --tp 2 --env SGLANG_M3_DENSE_CUDNN_CHUNK_PLANS=0 > $TOP/first_noplans.log 2>&1
grep -h "cuDNN plans\|prepared in" $TOP/*/server-*.log | cut -c1-200
grep -h "ttft" $TOP/first_*.log
find $TOP -size +4M -delete; OUT=$TOP scripts/gpu/run.sh pack > /dev/null
