"""fp8 KV cache end to end: the tiny M3 served with ``--kv-cache-dtype fp8_e4m3`` on the CPU platform,
against the session's shared server (same checkpoint and flags, unquantized float32 KV) and against
an independent oracle: transformers' M3 with its K/V rounded through e4m3 (``fp8_kv_oracle``).

The bound on the logprob drift comes from e4m3's precision: e4m3 keeps 3 mantissa bits, so every
stored K/V element moves by up to 2^-4 of its value, and how far that moves a logprob depends on
the model; the oracle measures exactly that on the same prompts, in code that shares nothing with
the server. Each server matches its oracle within ``LOGPROB_TOLERANCE`` (the project's served vs
transformers tolerance), so the served drift must equal the oracle's drift within twice that. The
drift must also be far larger than the tolerance, or the fp8 cache would not be in use. The
prompts cover a short one (dense: all blocks fit the top-4) and ones of 10 and 19 MSA blocks of 16
tokens, prefilled in chunks of 100 that start mid-block.
"""

from __future__ import annotations

import openai
import pytest
import requests
from fp8_kv_oracle import e4m3_greedy_tokens, e4m3_prompt_logprobs
from server_harness import TINY_PREFILL_CHUNK, launch_cpu_server
from transformers_oracle import prompt_logprobs, random_prompt

from tests.e2e.served_vs_reference import LOGPROB_TOLERANCE, NEW_TOKENS, generate, output_ids

pytestmark = pytest.mark.server

PROMPTS = {"p20": random_prompt(120, 20), "p150": random_prompt(250, 150), "p301": random_prompt(401, 301)}


@pytest.fixture(scope="module")
def fp8_kv_server(tiny_m3_checkpoint, server_log_dir, tiny_m3_server):
    """Started like the shared ``tiny_m3_server`` (conftest), plus the fp8 KV cache."""
    parsers = ("--reasoning-parser", "minimax_m3", "--tool-call-parser", "minimax_m3")
    chunking = ("--chunked-prefill-size", str(TINY_PREFILL_CHUNK))
    with launch_cpu_server(tiny_m3_checkpoint, server_log_dir, *parsers, *chunking, "--kv-cache-dtype", "fp8_e4m3") as server:
        yield server


def _prompt_logprobs(server, prompt):
    result = generate(server, prompt, logprob_start=0)
    entries = result["meta_info"]["input_token_logprobs"]
    assert [e[1] for e in entries] == prompt and entries[0][0] is None
    return result, [e[0] for e in entries[1:]]  # entry i + 1 predicts token i + 1, as the oracle's row i


def test_server_runs_with_the_fp8_kv_cache(fp8_kv_server):
    info = requests.get(f"{fp8_kv_server.base_url}/server_info", timeout=300).json()
    assert info["kv_cache_dtype"] == "fp8_e4m3"


@pytest.mark.parametrize("label", ["p20", "p150"])
def test_openai_greedy_completion_is_the_e4m3_oracles(fp8_kv_server, tiny_m3_checkpoint, label):
    prompt = PROMPTS[label]
    client = openai.OpenAI(base_url=fp8_kv_server.openai_url, api_key="none")
    completion = client.completions.create(model=fp8_kv_server.model_path, prompt=prompt, max_tokens=NEW_TOKENS, temperature=0)
    native = generate(fp8_kv_server, prompt)
    assert output_ids(native) == e4m3_greedy_tokens(tiny_m3_checkpoint, prompt, NEW_TOKENS), f"{label}: greedy tokens"
    assert completion.choices[0].text == native["text"], f"{label}: the openai completion is not the greedy one"
    assert completion.usage.completion_tokens == NEW_TOKENS


def test_logprob_drift_is_the_drift_e4m3_rounding_explains(tiny_m3_server, fp8_kv_server, tiny_m3_checkpoint):
    measured = {}
    for label, prompt in PROMPTS.items():
        base_result, base = _prompt_logprobs(tiny_m3_server, prompt)
        fp8_result, fp8 = _prompt_logprobs(fp8_kv_server, prompt)
        oracle, oracle_fp8 = prompt_logprobs(tiny_m3_checkpoint, prompt).tolist(), e4m3_prompt_logprobs(tiny_m3_checkpoint, prompt).tolist()
        to_oracle = max(abs(x - y) for x, y in zip(fp8, oracle_fp8))
        assert to_oracle < LOGPROB_TOLERANCE, f"{label}: fp8-KV logprobs {to_oracle} from the e4m3 oracle"
        served_drift = [x - y for x, y in zip(fp8, base)]
        oracle_drift = [x - y for x, y in zip(oracle_fp8, oracle)]
        mismatch = max(abs(x - y) for x, y in zip(served_drift, oracle_drift))
        assert mismatch < 2 * LOGPROB_TOLERANCE, f"{label}: served drift differs from the e4m3 oracle's by {mismatch}"
        drift = [abs(d) for d in served_drift]
        base_tokens, fp8_tokens = output_ids(base_result), output_ids(fp8_result)
        measured[label] = {"max_abs": max(drift), "mean_abs": sum(drift) / len(drift), "to_e4m3_oracle": to_oracle,
                           "greedy_agree": sum(a == b for a, b in zip(base_tokens, fp8_tokens))}
    print("[fp8 KV] prompt logprob drift vs the float32-KV server:", measured)
    # e4m3 rounding (up to 2^-4 relative per element) moves logprobs far beyond implementation noise
    assert max(m["max_abs"] for m in measured.values()) > 10 * LOGPROB_TOLERANCE
