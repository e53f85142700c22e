"""The project's tiny M3 served by real SGLang on a CUDA GPU, against transformers (fp32).

Text-only tiny checkpoints in both config layouts, each served with decode CUDA graphs, the MoE
through SGLang's fused (Triton) MoE layer, the MSA Triton backend (page size = MSA block = 16), a
prefill chunk of 100 tokens (chunks start mid-block) and the radix cache: greedy tokens must be
identical to transformers' and prompt logprobs close (fp32 with IEEE Triton dots; the fused MoE
rounds its GEMM outputs to fp16 for fp32 models, hence the looser bound than the CPU tests').
A second server runs the per-expert torch MoE eagerly, and both paths must agree.

Skipped without CUDA. Run on the lent GPU with ``scripts/gpu/run.sh tests``.
"""

from __future__ import annotations

import concurrent.futures
import os
import re
import sys

import pytest
import requests
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.server]

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

sys.path.insert(0, os.path.dirname(__file__))
from gpu_server import launch_gpu_server, log_text  # noqa: E402
from transformers_oracle import greedy_tokens, prompt_logprobs, random_prompt  # noqa: E402

PROMPTS = {"p61": random_prompt(4, 61), "p233": random_prompt(3, 233), "p310": random_prompt(1, 310), "p457": random_prompt(2, 457)}
NEW_TOKENS = 12
LOGPROB_TOLERANCE = 1e-2
FUSED_VS_TORCH_TOLERANCE = 1e-2
CHUNK = 112  # SGLang needs a multiple of the page size (16); prompts still end mid-block
CONCURRENT = 16


def generate(server, prompt_ids, max_new_tokens=NEW_TOKENS, logprob_start=None):
    body = {"input_ids": prompt_ids, "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": True}}
    if logprob_start is not None:
        body.update(return_logprob=True, logprob_start_len=logprob_start)
    response = requests.post(f"{server.base_url}/generate", json=body, timeout=600)
    response.raise_for_status()
    return response.json()


def output_ids(result) -> list[int]:
    return result["output_ids"] if "output_ids" in result else [t[1] for t in result["meta_info"]["output_token_logprobs"]]


def served_logprobs(result, prompt) -> dict[int, float]:
    entries = result["meta_info"]["input_token_logprobs"]
    start = len(prompt) - len(entries)
    assert [t[1] for t in entries] == prompt[start:]
    return {start + i: t[0] for i, t in enumerate(entries) if t[0] is not None}


def check(server, model_dir, prompt, label, result=None, logprob_start=0):
    result = result or generate(server, prompt, logprob_start=logprob_start)
    want = greedy_tokens(model_dir, prompt, NEW_TOKENS)
    got = output_ids(result)
    reference = prompt_logprobs(model_dir, prompt)
    diff = max(abs(v - reference[p - 1].item()) for p, v in served_logprobs(result, prompt).items())
    print(f"[gpu exact] {label}: tokens {'identical' if got == want else f'DIFFER {got} vs {want}'}, max |logprob diff| {diff:.2e}")
    assert got == want, f"greedy continuation of {label} differs"
    assert diff < LOGPROB_TOLERANCE, f"prompt logprobs of {label} differ by {diff}"
    return result


@pytest.fixture(scope="module", params=["shipped", "hf"])
def served(request, tiny_checkpoint_factory, server_log_dir):
    model_dir = tiny_checkpoint_factory(layout=request.param)
    with launch_gpu_server(model_dir, server_log_dir, "--chunked-prefill-size", str(CHUNK), name=f"graphs-{request.param}") as server:
        yield server, model_dir, request.param


def test_decode_cuda_graphs_captured_and_fused_moe_used(served):
    server, _, _ = served
    log = log_text(server)
    assert re.search(r"Capture .*decode.* end", log), "no decode CUDA graph capture in the server log"
    info = requests.get(f"{server.base_url}/get_server_info", timeout=30).json()
    assert not info.get("disable_cuda_graph", False)


@pytest.mark.parametrize("name", sorted(PROMPTS))
def test_chunked_prefill_and_graphed_decode_match_transformers(served, name):
    server, model_dir, layout = served
    check(server, model_dir, PROMPTS[name], f"{layout} {name}")


def test_radix_cache_hit_matches_transformers(served):
    server, model_dir, layout = served
    shared = random_prompt(11, 203)
    generate(server, shared + random_prompt(12, 40))
    second = shared + random_prompt(13, 157)
    result = generate(server, second, logprob_start=len(shared))
    assert result["meta_info"]["cached_tokens"] >= len(shared)
    check(server, model_dir, second, f"{layout} radix", result=result)


def test_sixteen_concurrent_requests_match_transformers(served):
    server, model_dir, layout = served
    prompts = [random_prompt(40 + i, 30 + 23 * i) for i in range(CONCURRENT)]
    with concurrent.futures.ThreadPoolExecutor(max_workers=CONCURRENT) as pool:
        results = list(pool.map(lambda p: generate(server, p, logprob_start=0), prompts))
    for prompt, result in zip(prompts, results):
        check(server, model_dir, prompt, f"{layout} concurrent len {len(prompt)}", result=result)


def test_fused_moe_agrees_with_torch_moe(tiny_checkpoint_factory, server_log_dir):
    """The same checkpoint with the per-expert torch MoE (eager) and with the fused layer (graphs)."""
    model_dir = tiny_checkpoint_factory()
    prompts = [PROMPTS["p233"], PROMPTS["p457"]]
    results = {}
    for impl, extra in (("torch", ("--disable-cuda-graph",)), ("fused", ())):
        with launch_gpu_server(model_dir, server_log_dir, *extra, env={"SGLANG_M3_MOE_IMPL": impl}, name=f"moe-{impl}") as server:
            results[impl] = [generate(server, p, logprob_start=0) for p in prompts]
    for prompt, a, b in zip(prompts, results["torch"], results["fused"]):
        la, lb = served_logprobs(a, prompt), served_logprobs(b, prompt)
        diff = max(abs(la[p] - lb[p]) for p in la)
        print(f"[fused vs torch MoE] len {len(prompt)}: tokens {'identical' if output_ids(a) == output_ids(b) else 'DIFFER'}, max |logprob diff| {diff:.2e}")
        assert output_ids(a) == output_ids(b)
        assert diff < FUSED_VS_TORCH_TOLERANCE
