"""The tiny M3 served on two GPUs at TP2 and at TP2 + EP2 equals the same model on one GPU and transformers.

fp32 (the graph-safe static torch MoE: SGLang's Triton fused MoE computes fp32 activations in
fp16): each layout's greedy tokens must be identical to the one-GPU server's and to transformers',
and prompt logprobs within the suite's 2e-3 of transformers (the one-GPU tests' criterion). Only
the order of partial sums changes between layouts (each all-reduce adds two rank partials where one
GPU sums the whole width), so the difference to the one-GPU server is printed for the record.

bf16 with the fused MoE (what a GPU node deploys), TP2 + EP2 against one GPU: the criterion of
``bf16_noise`` - every served token a near-argmax of the fp32 reference, and the two-GPU prompt
logprob noise at most 1.25x the one-GPU noise plus 0.05 (a wrong expert split or a rank's missing
shard moves logprobs by whole nats).

Decode CUDA graphs on every server; prefill chunks of 112 tokens, so prompts end mid-block.
SGLang's custom all-reduce is off: it is a compiled ``sgl_kernel`` op that the GPU harness's
stand-in does not have (a stock GPU node has it); NCCL all-reduces instead.

Needs two CUDA devices (``nvidia-h200-x2`` / ``nvidia-h100-x2``): ``scripts/gpu/run.sh tests -k tensor_parallel``.
"""

from __future__ import annotations

import os
import re
import sys

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.server]

if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
    pytest.skip("needs two CUDA devices", allow_module_level=True)

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "e2e"))
from bf16_noise import reference_gaps, served_logprobs  # noqa: E402
from gpu_server import launch_gpu_server, log_text  # noqa: E402
from served_vs_reference import NEW_TOKENS, assert_matches_reference, generate, logprob_diff, output_ids  # noqa: E402
from transformers_oracle import random_prompt  # noqa: E402

PROMPTS = {"p163": random_prompt(31, 163), "p397": random_prompt(32, 397)}
CHUNK = 112
#: layout -> (server flags, the log tag of the second rank: it must exist and name its EP rank)
LAYOUTS = {
    "tp2": (("--tp-size", "2", "--disable-custom-all-reduce"), " TP1]"),
    "tp2_ep2": (("--tp-size", "2", "--ep-size", "2", "--disable-custom-all-reduce"), " TP1 EP1]"),
}
FUSED_NOISE_RATIO, FUSED_NOISE_SLACK = 1.25, 0.05


def serve(model_dir, log_dir, flags=(), name="", **options):
    return launch_gpu_server(model_dir, log_dir, "--chunked-prefill-size", str(CHUNK), *flags, name=name,
                             prefill_graphs=False, **options)


@pytest.fixture(scope="module")
def one_gpu_fp32(tiny_checkpoint_factory, server_log_dir):
    """{prompt name: result} of the fp32 server on one GPU (started, queried, stopped)."""
    with serve(tiny_checkpoint_factory(), server_log_dir, name="tp-reference-fp32") as server:
        return {name: generate(server, prompt, logprob_start=0) for name, prompt in PROMPTS.items()}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_fp32_two_gpu_layout_equals_one_gpu_and_transformers(layout, one_gpu_fp32, tiny_checkpoint_factory, server_log_dir):
    model_dir = tiny_checkpoint_factory()
    flags, second_rank = LAYOUTS[layout]
    with serve(model_dir, server_log_dir, flags, name=f"fp32-{layout}") as server:
        log = log_text(server)
        assert second_rank in log, f"{layout}: no rank tagged '{second_rank.strip()}' in the server log"
        assert re.search(r"Capture .*decode.* end", log), f"{layout}: no decode CUDA graph capture"
        for name, prompt in PROMPTS.items():
            result = assert_matches_reference(server, model_dir, prompt, f"{layout} {name}")
            reference = one_gpu_fp32[name]
            assert output_ids(result) == output_ids(reference), f"{layout} {name}: greedy tokens differ from one GPU"
            ours, one = served_logprobs(result, prompt), served_logprobs(reference, prompt)
            print(f"[gpu {layout}] {name}: max |logprob - one GPU| {max(abs(ours[p] - one[p]) for p in ours):.2e}")


def test_bf16_fused_moe_tp2_ep2_within_one_gpu_noise(tiny_checkpoint_factory, server_log_dir):
    model_dir = tiny_checkpoint_factory()
    fused = {"SGLANG_M3_MOE_IMPL": "fused"}
    results = {}
    for layout, flags in (("tp1", ()), ("tp2_ep2", LAYOUTS["tp2_ep2"][0])):
        with serve(model_dir, server_log_dir, flags, name=f"bf16-fused-{layout}", dtype="bfloat16", env=fused) as server:
            assert "M3 MoE experts: fused path" in log_text(server)
            results[layout] = {name: generate(server, prompt, logprob_start=0) for name, prompt in PROMPTS.items()}
    failures = []
    for name, prompt in PROMPTS.items():
        noise = {}
        for layout, by_prompt in results.items():
            result = by_prompt[name]
            noise[layout] = logprob_diff(result, model_dir, prompt)
            gaps = reference_gaps(model_dir, prompt, output_ids(result))
            print(f"[gpu bf16 fused] {layout} {name}: prompt logprob noise {noise[layout]:.3e}, served-token gaps max {max(gaps):.3e}")
            if max(gaps) > 2 * noise[layout]:
                failures.append(f"{layout} {name}: a served token is {max(gaps)} below the fp32 argmax (noise {noise[layout]})")
        if noise["tp2_ep2"] > FUSED_NOISE_RATIO * noise["tp1"] + FUSED_NOISE_SLACK:
            failures.append(f"tp2_ep2 {name}: noise {noise['tp2_ep2']} vs one GPU {noise['tp1']}")
        same = sum(a == b for a, b in zip(output_ids(results["tp2_ep2"][name]), output_ids(results["tp1"][name])))
        print(f"[gpu bf16 fused] {name}: tokens equal to one GPU {same}/{NEW_TOKENS}")
    assert not failures, failures
