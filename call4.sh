#!/usr/bin/env bash
# device call 4: the bf16 tiny-M3 test on the sequence-noise bound; the offload EAGLE3 test the first call's limit cut
export M3_COMMIT=$(cat .m3commit 2>/dev/null || echo unknown)
TOP=$OUT
OUT=$TOP/check scripts/gpu/run.sh check > $TOP/check.log 2>&1 || tail -30 $TOP/check.log
mkdir -p $TOP/bf16 $TOP/offload
(CUDA_VISIBLE_DEVICES=0 M3_PLUGIN_DIR=/tmp/plugin0 OUT=$TOP/bf16 timeout -s INT 200 scripts/gpu/run.sh tests "tests/gpu/test_tiny_m3_gpu.py::test_bf16_fused_and_static_moe_within_bf16_noise" > $TOP/bf16.log 2>&1) &
(CUDA_VISIBLE_DEVICES=1 M3_PLUGIN_DIR=/tmp/plugin1 OUT=$TOP/offload timeout -s INT 200 scripts/gpu/run.sh tests "tests/gpu/test_offload_gpu.py::test_eagle3_chains_verified_through_the_block_caches" > $TOP/offload.log 2>&1) &
wait
grep -h "gpu bf16\]\|gpu offload\]\|passed\|failed" $TOP/bf16.log $TOP/offload.log | cut -c1-260
find $TOP -size +4M -delete; OUT=$TOP scripts/gpu/run.sh pack > /dev/null
