"""EAGLE3 chains on the CPU platform give the same greedy tokens as the target alone.

One target server and one speculative server (random tiny draft, chain of 3 drafts verified as
4 tokens), both with chunked prefill of ``TINY_PREFILL_CHUNK`` tokens. A random draft is mostly
rejected, so every step exercises the verify batch (4 query tokens per request through the dense
torch-native layer and the MSA layers) and the bonus-token path; accepted drafts are rarer (see
``test_eagle3_acceptance`` for a draft that is accepted). The tiny M3 has MSA blocks of 16 tokens
and top-4 blocks, so prompts past 64 tokens attend sparsely and a long prompt's verify windows
cross block boundaries while each verify token selects its own blocks.

The speculative server runs without ``TRITON_INTERPRET`` (see ``no_interpreter``), as a user's
plain ``serve`` on a CPU does: every speculative step of these tests goes through the plugin's
torch kernels, none through SGLang's Triton ones.
"""

from __future__ import annotations

import pytest
from server_harness import TINY_PREFILL_CHUNK, launch_cpu_server
from transformers_oracle import random_prompt

from tests.speculative.conftest import CHAIN_FLAGS
from tests.speculative.no_interpreter import launch_without_interpreter
from tests.speculative.spec_requests import accept_length, generate, generate_concurrently

pytestmark = pytest.mark.server

NEW_TOKENS = 16
CHUNKING = ("--chunked-prefill-size", str(TINY_PREFILL_CHUNK))
#: 300 tokens: 19 MSA blocks of 16 (top-4 chosen per token), prefilled in 3 chunks of 100.
LONG_PROMPT = random_prompt(31, 300)


@pytest.fixture(scope="module")
def servers(tiny_m3_checkpoint, tiny_draft_factory, server_log_dir):
    draft = tiny_draft_factory()
    with launch_cpu_server(tiny_m3_checkpoint, server_log_dir, *CHUNKING) as target:
        with launch_without_interpreter(
            tiny_m3_checkpoint, server_log_dir, *CHUNKING, *CHAIN_FLAGS, "--speculative-draft-model-path", draft
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


def test_eight_concurrent_requests_identical(servers):
    prompts = [random_prompt(200 + i, n) for i, n in enumerate([3, 17, 33, 64, 90, 120, 150, 210])]
    target, speculative = servers
    plain = generate_concurrently(target.base_url, prompts, NEW_TOKENS)
    spec = generate_concurrently(speculative.base_url, prompts, NEW_TOKENS)
    assert [r["output_ids"] for r in spec] == [r["output_ids"] for r in plain]
    length = accept_length(spec)
    print(f"random draft: accept length {length:.3f} tokens/step over {len(prompts)} concurrent requests")
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
