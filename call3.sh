#!/usr/bin/env bash
# device call 3: the bf16 served test with the shared expert separate, the fused-shared test; MSA kernel bench (quick)
export M3_COMMIT=e3fcdc6
TOP=$OUT
OUT=$TOP/check scripts/gpu/run.sh check > $TOP/check.log 2>&1 || tail -30 $TOP/check.log
lane0() {
  export CUDA_VISIBLE_DEVICES=0 M3_PLUGIN_DIR=/tmp/plugin0
  mkdir -p $TOP/bf16_separate $TOP/fused_shared
  SGLANG_M3_FUSE_SHARED_EXPERT=0 OUT=$TOP/bf16_separate timeout -s INT 170 scripts/gpu/run.sh tests "tests/gpu/test_tiny_m3_gpu.py::test_bf16_fused_and_static_moe_within_bf16_noise" > $TOP/bf16_separate.log 2>&1
  OUT=$TOP/fused_shared timeout -s INT 300 scripts/gpu/run.sh tests tests/gpu/test_fused_shared_expert_gpu.py > $TOP/fused_shared.log 2>&1
}
lane1() {
  export CUDA_VISIBLE_DEVICES=1 M3_PLUGIN_DIR=/tmp/plugin1
  mkdir -p $TOP/bench
  OUT=$TOP/bench MSA_COMMIT=e3fcdc6 timeout -s INT 440 scripts/gpu/run.sh exec python benchmarks/msa_kernel_bench.py --out $TOP/bench --quick > $TOP/bench.log 2>&1
}
lane0 & lane1 & wait
grep -h "gpu bf16\]\|passed\|failed" $TOP/bf16_separate.log $TOP/fused_shared.log | cut -c1-250
tail -40 $TOP/bench.log | cut -c1-250
find $TOP -size +4M -delete; OUT=$TOP scripts/gpu/run.sh pack > /dev/null
