"""The shared expert captured beside the routed experts on a second stream changes no value.

Kernel level: a CUDA graph captured through ``shared_beside_routed`` with a real second stream
replays to the same bits as the two callables run eagerly one after the other (same kernels on
the same inputs; only the stream differs), at 1, 16 and 64 rows. Served: the tiny M3 in bf16 on
the fused MoE with decode graphs gives the same greedy tokens and the same prompt and output
logprobs, bit for bit, with the overlap on and off (``SGLANG_M3_MOE_OVERLAP=0``), and only the
server with it on logs the two-stream capture. The served requests are sent one at a time: in
bf16 a row's result depends on the batch it shares (GEMM and fused-MoE tiles follow the row
count), and which requests share a batch under concurrency depends on arrival timing, so only
lone requests have one right answer to compare bit for bit; larger graphed batches are covered by
the kernel-level test and, served, by sixteen concurrent requests held to the bf16 criterion of
``bf16_noise`` against the fp32 reference (a race between the streams would give garbage, far
outside bf16 noise).

The overlap serves only where the shared expert is a separate MLP (a quantized shared expert,
expert parallelism); elsewhere the fused layer holds it (``test_fused_shared_expert_gpu``), so the
served tests here keep it separate (``SGLANG_M3_FUSE_SHARED_EXPERT=0``).

Skipped without CUDA. Run on the lent GPU with ``scripts/gpu/run.sh tests``.
"""

from __future__ import annotations

import concurrent.futures
import os
import sys

import pytest
import torch

pytestmark = [pytest.mark.gpu]

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "e2e"))
from bf16_noise import request_noise  # noqa: E402
from gpu_server import launch_gpu_server, log_text  # noqa: E402
from served_vs_reference import generate, output_ids  # noqa: E402
from test_tiny_m3_gpu import BF16_NOISE_CEILING  # noqa: E402
from transformers_oracle import random_prompt  # noqa: E402

from sglang_m3.models.fused_moe import FUSE_SHARED_ENV  # noqa: E402
from sglang_m3.models.moe_overlap import MOE_OVERLAP_ENV, shared_beside_routed  # noqa: E402

#: the fused MoE with its shared expert as a separate MLP, the layout the overlap serves
SEPARATE_SHARED = {"SGLANG_M3_MOE_IMPL": "fused", FUSE_SHARED_ENV: "0"}

CAPTURED_LINE = "shared expert captured beside the routed experts"


@pytest.mark.parametrize("rows", [1, 16, 64])
def test_two_stream_graph_replays_to_the_eager_bits(rows):
    torch.manual_seed(rows)
    device = torch.device("cuda")
    w_shared = torch.randn(6144, 1536, device=device, dtype=torch.bfloat16) / 40
    w_routed = torch.randn(6144, 3072, device=device, dtype=torch.bfloat16) / 40

    def shared(t):
        return torch.nn.functional.silu(t @ w_shared) @ w_shared.T

    def routed(t):
        return torch.sigmoid(t @ w_routed) @ w_routed.T

    x = torch.randn(rows, 6144, device=device, dtype=torch.bfloat16)
    alt = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm cuBLAS outside the capture, as SGLang's runner does
        shared_beside_routed(alt, x, shared, routed)
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        got_shared, got_routed = shared_beside_routed(alt, x, shared, routed)
    x.copy_(torch.randn_like(x))  # the replay must read the new input
    want_shared, want_routed = shared(x), routed(x)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(got_shared, want_shared)
    assert torch.equal(got_routed, want_routed)


PROMPTS = {f"p{length}": random_prompt(seed, length) for seed, length in enumerate((17, 61, 144, 233, 457))}
NEW_TOKENS = 40


def _serve_and_generate(model_dir, log_dir, overlap: str):
    with launch_gpu_server(
        model_dir, log_dir, "--chunked-prefill-size", "112",
        env={**SEPARATE_SHARED, MOE_OVERLAP_ENV: overlap},
        name=f"bf16-fused-overlap-{overlap}", dtype="bfloat16", prefill_graphs=False,
    ) as server:
        results = {name: generate(server, prompt, NEW_TOKENS, logprob_start=0) for name, prompt in PROMPTS.items()}
        return results, log_text(server)


def _logprobs(result) -> list[float]:
    meta = result["meta_info"]
    return [entry[0] for entry in meta["input_token_logprobs"] + meta["output_token_logprobs"] if entry[0] is not None]


def test_served_tokens_and_logprobs_equal_with_and_without_overlap(tiny_checkpoint_factory, server_log_dir):
    model_dir = tiny_checkpoint_factory()
    on, on_log = _serve_and_generate(model_dir, server_log_dir, "1")
    off, off_log = _serve_and_generate(model_dir, server_log_dir, "0")
    assert CAPTURED_LINE in on_log, "the server with the overlap on never captured it"
    assert CAPTURED_LINE not in off_log, "SGLANG_M3_MOE_OVERLAP=0 still captured the overlap"
    failures = []
    for name in PROMPTS:
        same_tokens = output_ids(on[name]) == output_ids(off[name])
        a, b = _logprobs(on[name]), _logprobs(off[name])
        worst = max(abs(x - y) for x, y in zip(a, b))
        print(f"[gpu overlap] {name}: tokens {'identical' if same_tokens else 'DIFFER'}, max |logprob on - off| {worst:.3e}")
        if not same_tokens or len(a) != len(b) or worst != 0.0:
            failures.append(f"{name}: tokens identical {same_tokens}, max |logprob diff| {worst}")
    assert not failures, failures


CONCURRENT = 16


def test_sixteen_concurrent_requests_with_overlap_within_bf16_noise(tiny_checkpoint_factory, server_log_dir):
    model_dir = tiny_checkpoint_factory()
    prompts = [random_prompt(100 + i, 30 + 23 * i) for i in range(CONCURRENT)]
    with launch_gpu_server(
        model_dir, server_log_dir, "--chunked-prefill-size", "112", env=SEPARATE_SHARED,
        name="bf16-fused-overlap-concurrent", dtype="bfloat16", prefill_graphs=False,
    ) as server:
        with concurrent.futures.ThreadPoolExecutor(CONCURRENT) as pool:
            results = list(pool.map(lambda p: generate(server, p, NEW_TOKENS, logprob_start=0), prompts))
        assert CAPTURED_LINE in log_text(server)
    failures = []
    for prompt, result in zip(prompts, results):
        noise, gap = request_noise(model_dir, prompt, result)
        print(f"[gpu overlap concurrent] len {len(prompt)}: noise {noise:.3e}, served-token gaps max {gap:.3e}")
        if noise > BF16_NOISE_CEILING or gap > 2 * noise:
            failures.append(f"len {len(prompt)}: noise {noise}, largest gap {gap}")
    assert not failures, failures
