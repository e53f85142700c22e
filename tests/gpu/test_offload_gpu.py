"""Sparse offload on a CUDA GPU: pinned-host K/V through the MSA Triton path, same answers as all-device.

Kernel level (no server): Triton accepts the page-locked host store as a kernel operand (SGLang's
HiCache allocation, mmap + ``cudaHostRegister``, and torch's ``pin_memory``); ``gather_pages``
copies host pages into a device cache and ``store_rows`` writes tokens into the host store and
the resident entries, exactly as torch indexing does; a block-cache fetch and a store captured
in one CUDA graph replay correctly with new pages each time (LRU evictions included).

Served: the tiny M3 (fp32, IEEE Triton dots; MSA blocks of 16 tokens, top-4, 2 KV heads: one
decode token selects at most 8 blocks per layer) with ``--page-size 16``, prefill chunks of 112
tokens, decode CUDA graphs and SGLang's prefill graphs, once with every K/V on the device and once
with ``SGLANG_M3_SPARSE_OFFLOAD_BLOCKS=16`` (16 cache entries per sparse layer: two requests per
fetch round, so 8 concurrent requests run 4 rounds per layer and step). Greedy tokens must be
identical and output logprobs equal within fp32 regrouping noise, for a 63-block prompt (four
times what a layer's cache holds: blocks are evicted and fetched again), 8 concurrent requests of
several blocks each, and a radix hit; the long prompt is also checked against transformers. An
EAGLE3 chain (3 drafts, 4 verify tokens per request) under offload exercises the target-verify
graphs through the block caches (64 entries: 4 tokens x 2 heads x top-4 = 32 per request).

Skipped without CUDA. Run on the lent GPU with ``scripts/gpu/run.sh tests -k offload``.
"""

from __future__ import annotations

import gc
import json
import os
import re
import sys

import pytest
import torch

pytestmark = [pytest.mark.gpu]

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "e2e"))
from gpu_server import launch_gpu_server, log_text  # noqa: E402
from offload_helpers import counters as log_counters  # noqa: E402
from offload_helpers import output_logprobs  # noqa: E402
from served_vs_reference import assert_matches_reference, generate, output_ids  # noqa: E402
from transformers_oracle import random_prompt  # noqa: E402

from msa_kernels.triton_offload import gather_pages, store_rows  # noqa: E402
from sglang_m3.cache.offload_block_cache import SparseBlockCache  # noqa: E402
from sglang_m3.cache.offload_pool import host_store_tensor  # noqa: E402
from sglang_m3.cache.page_locked import discard_last_cuda_error, page_locked_tensor  # noqa: E402
from sglang_m3.cache.offload_settings import SPARSE_OFFLOAD_BLOCKS_ENV, SPARSE_OFFLOAD_LOG_STEPS_ENV  # noqa: E402

BLOCK, CACHE_BLOCKS = 16, 16
CHUNKING = ("--chunked-prefill-size", "112")
OFFLOAD_ENV = {SPARSE_OFFLOAD_BLOCKS_ENV: str(CACHE_BLOCKS), SPARSE_OFFLOAD_LOG_STEPS_ENV: "1"}
NEW_TOKENS = 24
LONG_PROMPT = random_prompt(41, 1000)  # 63 blocks
CONCURRENT_LENGTHS = (70, 97, 130, 161, 200, 233, 290, 350)  # 5 to 22 blocks each
#: fp32 servers summing the same terms in another grouping (other batches, other rounds)
LOGPROB_NOISE = 1e-3


# -- kernels on page-locked host memory --------------------------------------------------------------


@pytest.mark.parametrize("allocation", ["host-register", "pin-memory"])
def test_kernels_read_and_write_the_page_locked_store(allocation):
    pages, heads, dim = 40, 4, 128
    generator = torch.Generator().manual_seed(0)
    if allocation == "host-register":
        host_k = host_store_tensor((pages * BLOCK, heads, dim), torch.bfloat16, True)
        host_v = host_store_tensor((pages * BLOCK, heads, dim), torch.bfloat16, True)
        assert torch.count_nonzero(host_k) == 0
    else:
        host_k = torch.zeros(pages * BLOCK, heads, dim, dtype=torch.bfloat16, pin_memory=True)
        host_v = torch.zeros(pages * BLOCK, heads, dim, dtype=torch.bfloat16, pin_memory=True)
    host_k.copy_(torch.randn(host_k.shape, generator=generator))
    host_v.copy_(torch.randn(host_v.shape, generator=generator))
    as_pages = lambda x: x.view(pages, BLOCK, heads, dim)  # noqa: E731
    cache_k = torch.zeros(9, BLOCK, heads, dim, dtype=torch.bfloat16, device="cuda")
    cache_v = torch.zeros_like(cache_k)
    src = torch.tensor([pages, 31, 2, pages, 17], device="cuda")
    dst = torch.tensor([8, 0, 5, 8, 3], device="cuda")  # 8: the scratch entry, skipped
    gather_pages(as_pages(host_k), as_pages(host_v), cache_k, cache_v, src, dst, skip_entry=8)
    torch.cuda.synchronize()
    for page, entry in ((31, 0), (2, 5), (17, 3)):
        assert torch.equal(cache_k[entry].cpu(), as_pages(host_k)[page])
        assert torch.equal(cache_v[entry].cpu(), as_pages(host_v)[page])
    assert torch.count_nonzero(cache_k[8]) == 0

    page_entry = torch.full((pages + 1,), -1, dtype=torch.long, device="cuda")
    page_entry[31] = 0
    loc = torch.tensor([31 * BLOCK + 5, 9 * BLOCK + 1], device="cuda")
    new_k = torch.randn(2, heads, dim, device="cuda").to(torch.bfloat16)
    new_v = torch.randn(2, heads, dim, device="cuda").to(torch.bfloat16)
    store_rows(loc, new_k, new_v, host_k, host_v, cache_k, cache_v, page_entry, BLOCK)
    torch.cuda.synchronize()
    assert torch.equal(host_k[loc.cpu()], new_k.cpu()) and torch.equal(host_v[loc.cpu()], new_v.cpu())
    assert torch.equal(cache_k[0, 5].cpu(), new_k[0].cpu())  # page 31 resident: written through


def test_a_freed_store_can_be_allocated_again():
    """Each store is unregistered when freed: a new mmap at the same address registers cleanly."""
    for _ in range(4):
        store = page_locked_tensor((64 * BLOCK, 4, 128), torch.bfloat16)  # HostRegisterError if a stale range remains
        store.fill_(1)
        del store
        gc.collect()
    torch.cuda.synchronize()  # no error left behind for the next launch check


def test_a_refused_registration_leaves_no_error_for_the_next_launch():
    buffer = torch.zeros(1 << 20, dtype=torch.uint8)
    cudart = torch.cuda.cudart()
    assert int(cudart.cudaHostRegister(buffer.data_ptr(), buffer.numel(), 0)) == 0
    try:
        assert int(cudart.cudaHostRegister(buffer.data_ptr(), buffer.numel(), 0)) != 0  # already registered
        discard_last_cuda_error()
        torch.ones(4, device="cuda").add_(1)
        torch.cuda.synchronize()
    finally:
        cudart.cudaHostUnregister(buffer.data_ptr())


def test_a_captured_fetch_and_store_replay_with_new_pages():
    pages, heads, dim, entries, wanted_len = 64, 2, 64, 6, 8
    host_k = host_store_tensor((pages * BLOCK, heads, dim), torch.float32, True)
    host_v = host_store_tensor((pages * BLOCK, heads, dim), torch.float32, True)
    host_k.copy_(torch.randn(host_k.shape))
    host_v.copy_(torch.randn(host_v.shape))
    cache = SparseBlockCache(entries, pages, BLOCK, heads, dim, dim, torch.float32, "cuda", kernel_copies=True)
    wanted = torch.full((wanted_len,), -1, dtype=torch.long, device="cuda")
    loc = torch.zeros(2, dtype=torch.long, device="cuda")
    k_new = torch.zeros(2, heads, dim, device="cuda")
    v_new = torch.zeros(2, heads, dim, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up (compiles the kernels) outside the capture
        cache.fetch(wanted, host_k, host_v)
        cache.write_rows(loc, k_new, v_new, host_k, host_v)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        cache.write_rows(loc, k_new, v_new, host_k, host_v)
        cache.fetch(wanted, host_k, host_v)
    generator = torch.Generator().manual_seed(3)
    for step in range(12):
        chosen = torch.randperm(pages, generator=generator)[: 1 + step % 5]  # at most 5 distinct: fit 6 entries
        wanted.fill_(-1)
        wanted[: chosen.numel()] = chosen.cuda()
        slots = chosen[:1] * BLOCK + torch.tensor([step % BLOCK])
        loc[:] = torch.cat([slots, slots + 0]).cuda()  # the same slot twice: same value either way
        value = torch.randn(1, heads, dim, generator=generator)
        k_new.copy_(value.expand(2, -1, -1))
        v_new.copy_(-value.expand(2, -1, -1))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(host_k[slots], value) and torch.equal(host_v[slots], -value)
        for page in chosen.tolist():
            entry = int(cache.page_entry[page])
            assert entry >= 0, f"step {step}: page {page} not resident after the fetch"
            assert torch.equal(cache.k_pages[entry].cpu(), cache.as_pages(host_k)[page])
            assert torch.equal(cache.v_pages[entry].cpu(), cache.as_pages(host_v)[page])
    assert int(cache.misses) > entries  # pages were evicted and fetched again


# -- served ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def on_device(tiny_m3_checkpoint, server_log_dir):
    with launch_gpu_server(tiny_m3_checkpoint, server_log_dir, *CHUNKING, name="offload-reference") as server:
        yield server


@pytest.fixture(scope="module")
def offloaded(tiny_m3_checkpoint, server_log_dir):
    with launch_gpu_server(tiny_m3_checkpoint, server_log_dir, *CHUNKING, env=OFFLOAD_ENV, name="offload") as server:
        yield server


def assert_same_answer(got, want, label):
    assert output_ids(got) == output_ids(want), f"greedy tokens of {label} differ with offload"
    diff = max(abs(a - b) for a, b in zip(output_logprobs(got), output_logprobs(want)))
    print(f"[gpu offload] {label}: tokens identical, max |output logprob diff| {diff:.2e}")
    assert diff < LOGPROB_NOISE, f"output logprobs of {label} differ by {diff}"


def counters(server) -> dict[str, int]:
    """The last block-cache totals the server logged (zeros before its first decode step)."""
    return log_counters(log_text(server))


def ask(server, prompt):
    return generate(server, prompt, max_new_tokens=NEW_TOKENS, logprob_start=len(prompt) - 1)


def test_the_offload_server_runs_the_cuda_path_with_graphs(offloaded):
    log = log_text(offloaded)
    assert "M3 sparse offload: MSA Triton path" in log
    assert re.search(r"M3 sparse offload: 3 sparse layers' K/V in a host store of \d+ slots \(\S+ GB, page-locked", log)
    assert re.search(r"Capture .*decode.* end", log), "no decode CUDA graph capture in the offload server's log"


def test_a_long_prompt_through_a_small_block_cache_answers_as_on_the_device(offloaded, on_device, tiny_m3_checkpoint):
    before = counters(offloaded)
    got = generate(offloaded, LONG_PROMPT, max_new_tokens=12, logprob_start=0)
    want = generate(on_device, LONG_PROMPT, max_new_tokens=12, logprob_start=0)
    assert_same_answer(got, want, "a 63-block prompt")
    assert_matches_reference(offloaded, tiny_m3_checkpoint, LONG_PROMPT, "a 63-block prompt under offload", result=got)
    after = counters(offloaded)
    assert after["steps"] > before["steps"], "the offload server logged no block-cache counters"
    assert after["misses"] - before["misses"] > 3 * CACHE_BLOCKS // 2, "decode fetched fewer blocks than expected"
    assert after["h2d_bytes"] > before["h2d_bytes"]
    record("long_prompt", before, after)


def test_eight_concurrent_requests_answer_as_on_the_device(offloaded, on_device):
    import concurrent.futures

    prompts = [random_prompt(300 + i, n) for i, n in enumerate(CONCURRENT_LENGTHS)]
    before = counters(offloaded)
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(lambda p: ask(offloaded, p), prompts))
        want = list(pool.map(lambda p: ask(on_device, p), prompts))
    for i, (a, b) in enumerate(zip(got, want)):
        assert_same_answer(a, b, f"concurrent request {i} ({CONCURRENT_LENGTHS[i]} tokens)")
    after = counters(offloaded)
    # 4 rounds of 2 requests per layer and step: each round evicts the last one's pages (few hits)
    assert after["steps"] > before["steps"] and after["misses"] > before["misses"]
    record("concurrent", before, after)


def test_a_radix_hit_answers_as_on_the_device(offloaded, on_device):
    prefix = random_prompt(60, 700)
    generate(offloaded, prefix + random_prompt(61, 30))
    second = prefix + random_prompt(62, 40)
    got = ask(offloaded, second)
    assert got["meta_info"]["cached_tokens"] >= len(prefix) // BLOCK * BLOCK, got["meta_info"]
    assert_same_answer(got, ask(on_device, second), "a radix hit")


def record(label, before, after):
    """Counters of a served test under ``$OUT`` (the benchmark's tiny-model companion numbers)."""
    out = os.environ.get("OUT")
    if not out:
        return
    path = os.path.join(out, "offload_gpu_tiny_counters.json")
    data = json.load(open(path)) if os.path.exists(path) else {}
    data[label] = {key: after[key] - before[key] for key in after}
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(data, handle, indent=2)


# -- EAGLE3 chains: target verify through the block caches --------------------------------------------


@pytest.fixture(scope="module")
def offloaded_chain(tiny_m3_checkpoint, tmp_path_factory, server_log_dir):
    from sglang_m3.speculative.tiny_draft import build_tiny_draft
    from tests.speculative.conftest import CHAIN_FLAGS

    draft = build_tiny_draft(tiny_m3_checkpoint, str(tmp_path_factory.mktemp("offload-draft")), copy_target_lm_head=True)
    env = {**OFFLOAD_ENV, SPARSE_OFFLOAD_BLOCKS_ENV: "64"}
    with launch_gpu_server(tiny_m3_checkpoint, server_log_dir, *CHUNKING, *CHAIN_FLAGS,
                           "--speculative-draft-model-path", draft, env=env, name="offload-eagle3") as server:
        yield server


def test_eagle3_chains_verified_through_the_block_caches(offloaded_chain, on_device):
    import concurrent.futures

    prompts = [LONG_PROMPT[:400], [139] * 80, *(random_prompt(500 + i, n) for i, n in enumerate((90, 150, 230)))]
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(lambda p: generate(offloaded_chain, p, max_new_tokens=NEW_TOKENS), prompts))
    want = [generate(on_device, p, max_new_tokens=NEW_TOKENS) for p in prompts]
    for i, (a, b) in enumerate(zip(got, want)):
        assert output_ids(a) == output_ids(b), f"EAGLE3 chain under offload, prompt {i}: greedy tokens differ"
        assert a["meta_info"].get("spec_verify_ct", 0) >= 1, "speculation did not run"
    assert "M3 sparse offload: MSA Triton path" in log_text(offloaded_chain)


@pytest.fixture(scope="module")
def offloaded_adaptive(tiny_m3_checkpoint, tmp_path_factory, server_log_dir):
    from sglang_m3.speculative.tiny_draft import build_tiny_draft
    from tests.speculative.conftest import CHAIN_FLAGS

    draft = build_tiny_draft(tiny_m3_checkpoint, str(tmp_path_factory.mktemp("adaptive-draft")), copy_target_lm_head=True)
    # 64 entries: the longest adaptive chain's 8 tokens x 2 heads x top-4, one request per round
    env = {**OFFLOAD_ENV, SPARSE_OFFLOAD_BLOCKS_ENV: "64"}
    with launch_gpu_server(tiny_m3_checkpoint, server_log_dir, *CHUNKING, *CHAIN_FLAGS, "--speculative-adaptive",
                           "--speculative-draft-model-path", draft, env=env, name="offload-adaptive") as server:
        yield server


def test_adaptive_chains_verified_through_the_block_caches(offloaded_adaptive, on_device):
    """SGLang's adaptive worker captures verify graphs for chains of 1, 3, 5 and 7 drafts over the
    block caches, whose fetch rounds were sized for the longest; repeating prompts grow the chain
    past the starting 3 while the sparse layers' K/V come from the host store. Same greedy tokens
    and output logprobs as the all-device server, one request at a time (batch size 1, where the
    candidates are 1-7)."""
    prompts = [[139] * 24, [140] * 30, [139] * 80, random_prompt(530, 200)]
    for i, prompt in enumerate(prompts):
        got = generate(offloaded_adaptive, prompt, max_new_tokens=40, logprob_start=len(prompt) - 1)
        want = generate(on_device, prompt, max_new_tokens=40, logprob_start=len(prompt) - 1)
        assert_same_answer(got, want, f"adaptive chain under offload, prompt {i}")
    log = log_text(offloaded_adaptive)
    assert "block caches of 64 blocks per layer" in log and "1 request(s) per fetch round" in log
    changes = [(int(a), int(b)) for a, b in re.findall(r"Adaptive spec params updated: steps (\d+) -> (\d+)", log)]
    print(f"[gpu offload] adaptive steps {changes}")
    assert any(b > 3 for _, b in changes), changes
