"""EAGLE3 draft trees served on a CUDA GPU by real SGLang: same greedy tokens as the target alone.

The chain test's checks (``test_eagle3_gpu.py``: short prompts, a 300-token prompt prefilled in
chunks and then hit in the radix cache, 8 concurrent requests of different lengths, repeating
prompts with their log-probabilities) run here against servers that verify draft trees: this
module imports those tests and their target server, and provides the server fixture they ask
for (``chain``: ``(draft kind, server)``) as a tree server. Nothing else differs, so a failure
here and not there points at tree verification.

The tiny M3 (fp32, IEEE Triton dots, page = MSA block = 16 tokens, prefill chunks of 112 tokens)
is served with decode and target-verify CUDA graphs and a draft tree: top-3 drafts per step over
3 steps, the best 8 tokens verified (``TREE_FLAGS``). Each verify token then selects its own MSA
blocks and attends only its ancestors among the drafts, in the Triton kernels' tree mode
(``msa_kernels.plan.DraftTree``, its rows copied from SGLang's tree mask before every graph
replay); the dense layers run SGLang's Triton attention backend, which reads the same tree mask
(named explicitly: SGLang verifies trees at page size > 1 only with fa3, flashinfer or triton,
and fa3 has no fp32).

Two drafts: the random tiny draft is mostly rejected, so every step runs the verify graph and
the bonus-token path, but the root attends no draft and a wrong tree mask would go unnoticed;
the lm-head-copy draft is accepted deep into the tree on prompts of a repeated token (the
imported test asks for an accept length above 2), so rows below the root decide tokens and
their log-probabilities are compared with the target's. On the CPU platform that comparison
failed on both repeating prompts with the tree read as a chain (tests/speculative/test_eagle3_exact.py).

Skipped without CUDA. Run on the lent GPU with ``scripts/gpu/run.sh tests -k eagle3_tree``.
"""

from __future__ import annotations

import os
import sys

import pytest
import requests
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.server]

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

sys.path.insert(0, os.path.dirname(__file__))
from gpu_server import launch_gpu_server, log_text  # noqa: E402
from test_eagle3_gpu import (  # noqa: E402, F401  (the chain tests, collected here again, and their target server)
    CHUNKING,
    target,
    test_accepted_drafts_keep_tokens_and_logprobs,
    test_eight_concurrent_requests_identical,
    test_long_chunked_prompt_then_radix_hit_identical,
    test_short_prompts_identical,
)

from sglang_m3.speculative import draft_extend  # noqa: E402
from sglang_m3.speculative.tiny_draft import build_tiny_draft  # noqa: E402
from tests.speculative.conftest import TREE_FLAGS  # noqa: E402

DENSE_TREE_BACKEND = ("--attention-backend", "triton")


@pytest.fixture(scope="module", params=["random", "copy"], name="chain")
def tree_server(request, tiny_m3_checkpoint, tmp_path_factory, server_log_dir):
    """``(draft kind, server)`` as the chain tests take it; the server verifies draft trees."""
    copy = request.param == "copy"
    draft = build_tiny_draft(tiny_m3_checkpoint, str(tmp_path_factory.mktemp(f"tree-draft-{request.param}")), copy_target_lm_head=copy)
    with launch_gpu_server(
        tiny_m3_checkpoint, server_log_dir, *CHUNKING, *TREE_FLAGS, *DENSE_TREE_BACKEND,
        "--speculative-draft-model-path", draft, name=f"eagle3-tree-{request.param}",
    ) as server:
        yield request.param, server


def test_tree_server_runs_graphs_with_trees(chain):
    _, server = chain
    log = log_text(server)
    assert "CUDA graph end" in log or "Capture" in log, "no CUDA graph capture in the tree server's log"
    assert "disable_cuda_graph=True" not in log
    # the servers inherit this process's environment, SGLANG_M3_DRAFT_EXTEND included
    assert (draft_extend.TAKEN_MESSAGE in log) == draft_extend.enabled()
    info = requests.get(f"{server.base_url}/get_server_info", timeout=30).json()
    assert info["speculative_eagle_topk"] == 3 and info["speculative_num_draft_tokens"] == 8, info
    assert info["attention_backend"] == "triton", info
