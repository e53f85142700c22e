"""A served prompt long enough for the KV-block-major prefill attention, against transformers (GPU).

The other served GPU tests use prompts of at most a few hundred tokens, so their extends take the
query-major attention; since the counting sort, an extend of 4K new tokens takes the block-major
form (``msa_kernels.plan.BLOCK_MAJOR_FROM``). This serves the tiny M3 (fp32, page = MSA block =
16, top-4 blocks) one prompt of 4,600 tokens in a single chunk and checks its greedy continuation
and prompt logprobs against transformers' ``minimax_m3_vl``. The tiny checkpoint is built for
4,096 positions; a copy whose config allows 8,192 serves the prompt (rotary positions need no
trained table). Skipped without CUDA; run with ``scripts/gpu/run.sh tests``.
"""

import json
import os
import shutil
import sys

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.server]

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "e2e"))
from bf16_noise import served_logprobs  # noqa: E402
from gpu_server import launch_gpu_server  # noqa: E402
from served_vs_reference import LOGPROB_TOLERANCE, NEW_TOKENS, generate, output_ids  # noqa: E402
from transformers_oracle import greedy_tokens, prompt_logprobs, random_prompt  # noqa: E402

PROMPT_TOKENS = 4600
POSITIONS = 8192


def _with_positions(config, positions: int):
    """Every ``max_position_embeddings`` of a (nested) config set to ``positions``."""
    if isinstance(config, dict):
        return {k: positions if k == "max_position_embeddings" else _with_positions(v, positions) for k, v in config.items()}
    return config


@pytest.fixture(scope="module")
def long_context_checkpoint(tiny_m3_checkpoint, tmp_path_factory):
    target = str(tmp_path_factory.mktemp("tiny-8k") / "model")
    shutil.copytree(tiny_m3_checkpoint, target)
    path = os.path.join(target, "config.json")
    with open(path, encoding="utf-8") as handle:
        config = json.load(handle)
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(_with_positions(config, POSITIONS), handle, indent=1)
    return target


def test_a_block_major_prefill_serves_as_transformers_answers(long_context_checkpoint, server_log_dir):
    from msa_kernels.plan import block_major_pays

    assert block_major_pays(PROMPT_TOKENS, PROMPT_TOKENS), "the prompt no longer reaches the block-major form"
    prompt = random_prompt(14, PROMPT_TOKENS)
    with launch_gpu_server(
        long_context_checkpoint, server_log_dir, "--chunked-prefill-size", "8192", "--context-length", str(POSITIONS),
        name="fp32-block-major", prefill_graphs=False,
    ) as server:
        result = generate(server, prompt, logprob_start=0)
    want = greedy_tokens(long_context_checkpoint, prompt, NEW_TOKENS)
    reference = prompt_logprobs(long_context_checkpoint, prompt)
    diff = max(abs(v - reference[p - 1].item()) for p, v in served_logprobs(result, prompt).items())
    print(f"[gpu block-major] {PROMPT_TOKENS}-token prompt: max |prompt logprob diff| {diff:.2e}")
    assert output_ids(result) == want
    assert diff < LOGPROB_TOLERANCE
