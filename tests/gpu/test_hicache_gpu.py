"""M3 on SGLang's hierarchical cache on a CUDA GPU (issue 16 item 1, the harness run).

``tests/cache/test_hicache_server.py`` serves the same scenario on the CPU platform; here the
device pool is GPU memory, the host tier page-locked host memory, and the index keys move with
the K/V through ``M3IndexedKVPoolHost``'s CUDA path. The tiny M3 (fp32, page 16, decode graphs)
gets a 1024-token device pool; a 300-token prefix is served, pushed out to the host by three
400-token prompts, and reused: its whole pages (288 tokens) must come back from the host tier and give the
greedy tokens of transformers and of a server without a host tier.

The K/V move through ``--hicache-io-backend direct`` (``sgl_kernel.kvcacheio.transfer_kv_direct``;
on the lent GPU the harness's torch stand-in of it, since the compiled wheel cannot travel
there). Skipped without CUDA. Run with ``scripts/gpu/run.sh tests -k hicache``.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.server]

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "e2e"))
from gpu_server import launch_gpu_server, log_text  # noqa: E402
from served_vs_reference import assert_matches_reference, generate, output_ids  # noqa: E402
from transformers_oracle import random_prompt  # noqa: E402

DEVICE_TOKENS = 1024
PAGE = 16  # gpu_server_args' page size: the radix tree caches whole pages only
PREFIX = random_prompt(21, 300)
CACHED_PREFIX = len(PREFIX) // PAGE * PAGE
HICACHE = (
    "--context-length", str(DEVICE_TOKENS), "--max-total-tokens", str(DEVICE_TOKENS), "--chunked-prefill-size", "112",
    "--enable-hierarchical-cache", "--hicache-size", "1", "--hicache-io-backend", "direct", "--hicache-mem-layout", "layer_first",
    "--enable-cache-report",  # the per-tier cached_tokens_details in meta_info
)


@pytest.fixture(scope="module")
def host_tiered(tiny_m3_checkpoint, server_log_dir):
    with launch_gpu_server(tiny_m3_checkpoint, server_log_dir, *HICACHE, name="hicache") as server:
        yield server


@pytest.fixture(scope="module")
def device_only(tiny_m3_checkpoint, server_log_dir):
    with launch_gpu_server(tiny_m3_checkpoint, server_log_dir, name="hicache-reference") as server:
        yield server


def test_the_m3_host_pool_carries_the_index_keys(host_tiered):
    log = log_text(host_tiered)
    assert "pools=KV + M3 index keys" in log and "hicache_attached=True" in log


def test_a_prefix_evicted_to_host_memory_comes_back_exactly(host_tiered, device_only, tiny_m3_checkpoint):
    generate(host_tiered, PREFIX + random_prompt(22, 20))
    for seed in range(3):  # 3 x 400 tokens through a 1024-token device pool evict the prefix
        generate(host_tiered, random_prompt(30 + seed, 400))
    second = PREFIX + random_prompt(23, 30)
    # logprobs from the end of the prefix: SGLang caps a request's prefix match at its
    # logprob_start_len, so logprobs from token 0 would bypass both cache tiers
    result = generate(host_tiered, second, logprob_start=len(PREFIX))

    assert result["meta_info"]["cached_tokens_details"] == {"device": 0, "host": CACHED_PREFIX}
    assert_matches_reference(host_tiered, tiny_m3_checkpoint, second, "a host-tier hit on the GPU", result=result)
    assert output_ids(result) == output_ids(generate(device_only, second)), "differs from the server without a host tier"
