"""EAGLE3 chains and draft trees on the CPU platform give the same greedy tokens as the target alone.

One target server and, in turn, a chain server (random tiny draft, 3 drafts verified as 4
tokens), a long-chain server (7 drafts verified as 8 tokens) and a tree server (top-3 branches
over 3 draft steps, 8 verify tokens), all with chunked prefill of ``TINY_PREFILL_CHUNK`` tokens;
then a chain under SGLang's ``--speculative-adaptive``, whose length changes between verify
steps. A random draft is mostly rejected, so every step exercises the verify batch (through the dense torch-native layer and the MSA layers) and the
bonus-token path; accepted drafts are rarer (see ``test_eagle3_acceptance`` for a draft that is
accepted). The tiny M3 has MSA blocks of 16 tokens and top-4 blocks, so prompts past 64 tokens
attend sparsely and a long prompt's verify windows cross block boundaries while each verify
token selects its own blocks.

For trees, the random draft shows that the tree path serves (drafting, verify, KV moves of the
accepted path, radix reuse, concurrency) without changing the answer, but the verified bonus
token (the root) attends no draft, so these comparisons would not notice a wrong tree mask. The
lm-head-copy draft is accepted deep into the tree on prompts of a repeated token (accept length
above 2), so there its rows below the root decide tokens, and their log-probabilities are
compared too: with the MSA planner made to read trees as chains (siblings visible, positions by
slot) that test failed on both repeating prompts (different tokens, log-probabilities off by up
to 0.95) while the random-draft tests still passed. Per-token tree semantics are tested against
a brute-force oracle in ``test_tree_verify_attention``.

The speculative servers run without ``TRITON_INTERPRET`` (see ``no_interpreter``), as a user's
plain ``serve`` on a CPU does: every speculative step of these tests goes through the plugin's
torch kernels, none through SGLang's Triton ones.
"""

from __future__ import annotations

import re

import pytest
from server_harness import TINY_PREFILL_CHUNK, launch_cpu_server
from transformers_oracle import random_prompt

from offload_helpers import counters as offload_counters

from sglang_m3.cache.offload_settings import SPARSE_OFFLOAD_BLOCKS_ENV, SPARSE_OFFLOAD_LOG_STEPS_ENV
from tests.speculative.conftest import CHAIN_FLAGS, LONG_CHAIN_FLAGS, TREE_FLAGS
from tests.speculative.no_interpreter import launch_without_interpreter
from tests.speculative.spec_requests import accept_length, generate, generate_concurrently

pytestmark = pytest.mark.server

NEW_TOKENS = 16
CHUNKING = ("--chunked-prefill-size", str(TINY_PREFILL_CHUNK))
#: 300 tokens: 19 MSA blocks of 16 (top-4 chosen per token), prefilled in 3 chunks of 100.
LONG_PROMPT = random_prompt(31, 300)
REPEATING_TOKENS = (139, 140)  # the tiny M3 repeats them (see test_eagle3_acceptance)
#: tokens per request in the adaptive test: the first repeating prompt's 10 verify steps pass
#: SGLang's adaptive warm-up (10 batches), so the chain can grow during the second
ADAPTIVE_TOKENS = 40
DRAFT_SHAPES = {"chain": CHAIN_FLAGS, "long_chain": LONG_CHAIN_FLAGS, "tree": TREE_FLAGS}


@pytest.fixture(scope="module")
def target(tiny_m3_checkpoint, server_log_dir):
    with launch_cpu_server(tiny_m3_checkpoint, server_log_dir, *CHUNKING) as server:
        yield server


@pytest.fixture(scope="module", params=list(DRAFT_SHAPES))
def servers(request, target, tiny_m3_checkpoint, tiny_draft_factory, server_log_dir):
    draft = tiny_draft_factory()
    flags = DRAFT_SHAPES[request.param]
    with launch_without_interpreter(
        tiny_m3_checkpoint, server_log_dir, *CHUNKING, *flags, "--speculative-draft-model-path", draft
    ) as speculative:
        yield target, speculative


def _both(servers, prompt: list[int]) -> tuple[dict, dict]:
    target, speculative = servers
    return generate(target.base_url, prompt, NEW_TOKENS), generate(speculative.base_url, prompt, NEW_TOKENS)


@pytest.mark.parametrize("length", [1, 40])
def test_short_prompts_identical(servers, length):
    plain, spec = _both(servers, random_prompt(100 + length, length))
    assert spec["output_ids"] == plain["output_ids"]
    assert spec["meta_info"]["spec_verify_ct"] >= 1  # speculation really ran


def test_long_chunked_prompt_then_radix_hit_identical(servers):
    """300 tokens (sparse attention, 3 prefill chunks), then the same prompt again from the radix cache."""
    plain, spec = _both(servers, LONG_PROMPT)
    assert spec["output_ids"] == plain["output_ids"]
    again = generate(servers[1].base_url, LONG_PROMPT, NEW_TOKENS)
    assert again["meta_info"]["cached_tokens"] >= 256, again["meta_info"]
    assert again["output_ids"] == plain["output_ids"]


def test_eight_concurrent_requests_identical(servers, request):
    prompts = [random_prompt(200 + i, n) for i, n in enumerate([3, 17, 33, 64, 90, 120, 150, 210])]
    target, speculative = servers
    plain = generate_concurrently(target.base_url, prompts, NEW_TOKENS)
    spec = generate_concurrently(speculative.base_url, prompts, NEW_TOKENS)
    assert [r["output_ids"] for r in spec] == [r["output_ids"] for r in plain]
    length = accept_length(spec)
    print(f"random draft: accept length {length:.3f} tokens/step over {len(prompts)} concurrent requests ({request.node.callspec.params['servers']})")
    # A random draft is accepted about as often as chance; at least the bonus token is committed.
    assert 1.0 <= length < 1.5


def test_sampled_request_is_refused_and_the_server_keeps_serving(servers):
    """SGLang has no sampled verification off CUDA (it killed the scheduler): a 400 naming the fields."""
    import requests

    _, speculative = servers
    response = requests.post(
        f"{speculative.base_url}/generate",
        json={"input_ids": random_prompt(400, 12), "sampling_params": {"temperature": 0.8, "max_new_tokens": 4}},
        timeout=600,
    )
    assert response.status_code == 400, response.text
    assert "temperature" in response.text and "top_k" in response.text
    plain, spec = _both(servers, random_prompt(401, 20))
    assert spec["output_ids"] == plain["output_ids"]


def _assert_same_tokens_and_logprobs(spec: list[dict], plain: list[dict]) -> None:
    assert [r["output_ids"] for r in spec] == [r["output_ids"] for r in plain]
    for with_draft, alone in zip(spec, plain):
        got = [entry[0] for entry in with_draft["meta_info"]["output_token_logprobs"]]
        want = [entry[0] for entry in alone["meta_info"]["output_token_logprobs"]]
        # float32 servers summing the same terms in another grouping (measured <= 2.7e-6)
        assert max(abs(a - b) for a, b in zip(got, want)) < 1e-4


@pytest.mark.parametrize(("shape", "least_accepted"), [("tree", 2.0), ("long_chain", 4.0)])
def test_copy_draft_is_exact_and_accepted_deep(shape, least_accepted, target, tiny_m3_checkpoint, tiny_draft_factory, server_log_dir):
    """The lm-head-copy draft in a tree and in a chain of 7: deep paths accepted on repeating
    prompts, same tokens and log-probabilities as the target alone (the accepted tokens'
    log-probabilities come from verify rows past the first, which attend the drafts along their
    paths). The long chain must accept more than a chain of 3 can at all (4 tokens per step), so
    its verify rows 5 to 8 decide tokens."""
    draft = tiny_draft_factory(copy_target_lm_head=True)
    prompts = [[REPEATING_TOKENS[0]] * 24, [REPEATING_TOKENS[1]] * 30, LONG_PROMPT[:200]]
    plain = [generate(target.base_url, prompt, NEW_TOKENS, logprobs=True) for prompt in prompts]
    with launch_without_interpreter(
        tiny_m3_checkpoint, server_log_dir, *CHUNKING, *DRAFT_SHAPES[shape], "--speculative-draft-model-path", draft
    ) as copy_server:
        spec = [generate(copy_server.base_url, prompt, NEW_TOKENS, logprobs=True) for prompt in prompts]
    _assert_same_tokens_and_logprobs(spec, plain)
    repeating = accept_length(spec[:2])
    print(f"lm-head-copy draft, {shape}, repeating target: accept length {repeating:.3f} tokens/step")
    assert repeating > least_accepted


def test_adaptive_chain_follows_acceptance_and_stays_exact(target, tiny_m3_checkpoint, tiny_draft_factory, server_log_dir):
    """SGLang's ``--speculative-adaptive`` re-picks the chain's length between verify steps (1, 3, 5
    or 7 drafts at batch size 1) from the acceptance it sees, so verify batches change width
    mid-request and the MSA plans must follow. The copy draft on repeating prompts grows the chain
    past 3 drafts (an accept length above 4 is out of a chain of 3's reach); ordinary prompts, where
    it is rejected, shrink it. Every token and log-probability equals the target's alone."""
    draft = tiny_draft_factory(copy_target_lm_head=True)
    repeating = [[REPEATING_TOKENS[0]] * 24, [REPEATING_TOKENS[1]] * 30]
    ordinary = [random_prompt(500 + i, n) for i, n in enumerate((12, 90, 200))]
    plain = [generate(target.base_url, prompt, ADAPTIVE_TOKENS, logprobs=True) for prompt in repeating + ordinary]
    with launch_without_interpreter(
        tiny_m3_checkpoint, server_log_dir, *CHUNKING, *CHAIN_FLAGS, "--speculative-adaptive",
        "--speculative-draft-model-path", draft,
    ) as adaptive:
        spec = [generate(adaptive.base_url, prompt, ADAPTIVE_TOKENS, logprobs=True) for prompt in repeating + ordinary]
        with open(adaptive.log_path, encoding="utf-8", errors="replace") as handle:
            changes = [(int(a), int(b)) for a, b in re.findall(r"Adaptive spec params updated: steps (\d+) -> (\d+)", handle.read())]
    _assert_same_tokens_and_logprobs(spec, plain)
    grown = accept_length(spec[1:2])
    print(f"adaptive chain: steps {changes}; second repeating prompt accept length {grown:.3f} tokens/step")
    assert any(b > a for a, b in changes) and any(b < a for a, b in changes), changes
    assert grown > 4.0


def test_adaptive_chain_under_sparse_offload_reads_its_longest_chain_through_the_block_caches(
        target, tiny_m3_checkpoint, tiny_draft_factory, server_log_dir):
    """Sparse offload sizes its block caches' fetch rounds once, at start-up; under adaptive
    speculation they are sized for the longest chain SGLang may switch to (7 drafts: 8 verify
    tokens x 2 KV heads x top-4 = 64 blocks per request), so the server starts with a chain of 3
    and a cache of exactly 64 blocks, one request per round (pages of 16 tokens, the MSA block,
    and chunks of 112, a multiple of the page). The copy draft on repeating prompts
    grows the chain past 3 drafts while the verify steps read the sparse layers' K/V from the host
    store; every token and log-probability equals the all-device target's alone."""
    draft = tiny_draft_factory(copy_target_lm_head=True)
    prompts = [[REPEATING_TOKENS[0]] * 24, [REPEATING_TOKENS[1]] * 30, random_prompt(520, 200)]
    plain = [generate(target.base_url, prompt, ADAPTIVE_TOKENS, logprobs=True) for prompt in prompts]
    env = {SPARSE_OFFLOAD_BLOCKS_ENV: "64", SPARSE_OFFLOAD_LOG_STEPS_ENV: "1"}
    with launch_without_interpreter(
        tiny_m3_checkpoint, server_log_dir, "--chunked-prefill-size", "112", "--page-size", "16", *CHAIN_FLAGS,
        "--speculative-adaptive",
        "--speculative-draft-model-path", draft, env=env,
    ) as offloaded:
        spec = [generate(offloaded.base_url, prompt, ADAPTIVE_TOKENS, logprobs=True) for prompt in prompts]
        with open(offloaded.log_path, encoding="utf-8", errors="replace") as handle:
            log = handle.read()
    _assert_same_tokens_and_logprobs(spec, plain)
    assert "block caches of 64 blocks per layer" in log and "1 request(s) per fetch round" in log
    changes = [(int(a), int(b)) for a, b in re.findall(r"Adaptive spec params updated: steps (\d+) -> (\d+)", log)]
    grown = accept_length(spec[1:2])
    print(f"adaptive chain under offload: steps {changes}; second repeating prompt accept length {grown:.3f}")
    assert any(b > 3 for _, b in changes), changes
    assert grown > 4.0  # out of a chain of 3's reach: longer chains were verified through the caches
    assert offload_counters(log)["misses"] > 0

