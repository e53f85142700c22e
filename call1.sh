#!/usr/bin/env bash
# device call 1: cuDNN chunk plans A/B (first prompt, TP1) + offload and dense GPU tests
export M3_COMMIT=bdd06f9
TOP=$OUT
mkdir -p /tmp/pyspy && xz -dc scripts/gpu/build/py-spy.xz > /tmp/pyspy/py-spy && chmod +x /tmp/pyspy/py-spy
OUT=$TOP/check scripts/gpu/run.sh check > $TOP/check.log 2>&1 || { tail -30 $TOP/check.log; }
lane0() {
  export CUDA_VISIBLE_DEVICES=0 M3_PLUGIN_DIR=/tmp/plugin0 OUT=$TOP/lane0
  mkdir -p $OUT
  timeout -s INT 50 scripts/gpu/run.sh exec python benchmarks/dense_prefill_host.py --out $OUT --prepare --prompts 32768 --passes 2 --profiled-passes 0 > $OUT/host_prepared.log 2>&1
  timeout -s INT 50 scripts/gpu/run.sh exec python benchmarks/dense_prefill_host.py --out $OUT --prompts 32768 --passes 2 --profiled-passes 0 --label unprepared > $OUT/host_unprepared.log 2>&1
  timeout -s INT 205 scripts/gpu/run.sh exec python benchmarks/first_prompt_profile.py --out $OUT/plans --py-spy /tmp/pyspy/py-spy --tp 1 > $OUT/first_plans.log 2>&1
  timeout -s INT 185 scripts/gpu/run.sh exec python benchmarks/first_prompt_profile.py --out $OUT/noplans --py-spy /tmp/pyspy/py-spy --tp 1 --env SGLANG_M3_DENSE_CUDNN_CHUNK_PLANS=0 > $OUT/first_noplans.log 2>&1
}
lane1() {
  export CUDA_VISIBLE_DEVICES=1 M3_PLUGIN_DIR=/tmp/plugin1 OUT=$TOP/lane1
  mkdir -p $OUT
  timeout -s INT 80 scripts/gpu/run.sh tests tests/gpu/test_dense_prefix_split_gpu.py > $OUT/dense_tests.log 2>&1
  mkdir -p $OUT/bf16 && OUT=$OUT/bf16 timeout -s INT 220 scripts/gpu/run.sh tests "tests/gpu/test_tiny_m3_gpu.py::test_bf16_fused_and_static_moe_within_bf16_noise" > $OUT/bf16_tests.log 2>&1
  mkdir -p $OUT/offload && OUT=$OUT/offload timeout -s INT 195 scripts/gpu/run.sh tests tests/gpu/test_offload_gpu.py > $OUT/offload_tests.log 2>&1
}
lane0 & lane1 & wait
grep -h "prepare_cudnn\|^pass" $TOP/lane0/host_*.log | cut -c1-600
grep -h "ttft\|Error\|error" $TOP/lane0/first_*.log | head -20
tail -3 $TOP/lane1/dense_tests.log; tail -3 $TOP/lane1/bf16_tests.log; tail -3 $TOP/lane1/offload_tests.log
find $TOP -size +4M -delete; OUT=$TOP scripts/gpu/run.sh pack > /dev/null
