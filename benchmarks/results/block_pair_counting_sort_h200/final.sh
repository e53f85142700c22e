#!/usr/bin/env bash
set -u
C=81d9c36; export M3_COMMIT=$C
R=scripts/gpu/run.sh
T0=$(date +%s)
timeout 340 $R exec python3 benchmarks/msa_kernel_bench.py --out $OUT/prefill --prefill-only --commit $C > $OUT/prefill.log 2>&1; echo "bench rc=$? $(( $(date +%s) - T0 )) s"
tail -3 $OUT/prefill.log
mkdir -p $OUT/tests $OUT/c32k
OUT=$OUT/tests timeout 150 $R tests tests/kernels/test_msa_gpu.py tests/kernels/test_msa_prepare.py -k "prefill or block_major or prepare or compiles" > /dev/null 2>&1; tail -2 $OUT/tests/gpu_tests.log; echo "tests $(( $(date +%s) - T0 )) s"
OUT=$OUT/c32k timeout 70 $R exec python3 benchmarks/prefill_attention_forms.py --n 131072 --chunk 32768 2>&1 | tail -2; echo "c32k $(( $(date +%s) - T0 )) s"
