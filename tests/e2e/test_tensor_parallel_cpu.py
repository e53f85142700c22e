"""The tiny M3 served at TP2, at TP2 + EP2 and at PP2 by the real SGLang server on the CPU
platform equals the same model at TP1 (the session's shared server) and transformers.

Two ranks run as two scheduler processes talking through gloo. TP2 splits the tiny model's 8 query
/ 2 KV heads to 4 / 1 per rank (so each rank keeps one index head, its KV group's), the dense MLP,
the shared expert and every routed expert's width; TP2 + EP2 instead gives each rank 4 whole
experts (``sglang_m3.models.moe``). PP2 gives the first stage the embedding and layers 0-1 (the
dense layer and a sparse one), the second layers 2-3 (sparse), the final norm and the output
layer; the first hands the layer output and residual stream to the second (``PPProxyTensors``),
each loads only its own tensors and keeps its own layers' KV and index keys. The servers take
the shared server's flags (prefill chunks of 100 tokens, starting mid-block), and the prompts span
10 to 25 MSA blocks of 16 tokens (top-4 blocks chosen), so block selection and chunked prefill are
both exercised on every rank.

Criteria. The model is float32 and every rank computes the same routing and block selection;
only the order in which partial sums are added changes (each all-reduce adds two rank partials in
place of one sum over the whole width; PP2 changes no sum at all). Greedy tokens must be identical
to TP1's. Prompt logprobs must agree with TP1's within ``TP_LOGPROB_TOLERANCE`` and with
transformers within the suite's usual 2e-3. Measured on both prompts (2 and 4 prefill chunks): max
|logprob - TP1| 1.9e-6 at TP2 and at TP2 + EP2 (a few float32 ulps of logprobs near -7), 0 at PP2,
max |logprob - transformers| 2.9e-6 (1.9e-6 at PP2); greedy tokens identical. A mis-sharded head
or expert moves logprobs by far more (a single changed MSA block choice moves them by 1e-2 and
beyond, test_index_fp8_served.py).
"""

from __future__ import annotations

import pytest
from server_harness import TINY_PREFILL_CHUNK, launch_cpu_server
from transformers_oracle import random_prompt

from tests.e2e.served_vs_reference import assert_matches_reference, generate, output_ids

pytestmark = pytest.mark.server

PROMPTS = {"p163": random_prompt(31, 163), "p397": random_prompt(32, 397)}
#: 5x the measured 1.9e-6 (module docstring): float32 reordering, nothing else.
TP_LOGPROB_TOLERANCE = 1e-5

#: layout -> (server flags, lines its log must hold: the second rank's tag, naming its EP rank or
#: pipeline stage; under PP each stage's loader passing over the other stage's tensors)
LAYOUTS = {
    "tp2": (("--tp-size", "2"), (" TP1]",)),
    "tp2_ep2": (("--tp-size", "2", "--ep-size", "2"), (" TP1 EP1]",)),
    "pp2": (("--pp-size", "2"), ("PP1", "other pipeline stages hold")),
}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def parallel_server(request, tiny_m3_checkpoint, server_log_dir):
    """A server of the shared one's flags (conftest ``tiny_m3_server``) at one parallel layout."""
    parsers = ("--reasoning-parser", "minimax_m3", "--tool-call-parser", "minimax_m3")
    chunking = ("--chunked-prefill-size", str(TINY_PREFILL_CHUNK))
    flags, _ = LAYOUTS[request.param]
    with launch_cpu_server(tiny_m3_checkpoint, server_log_dir, *parsers, *chunking, *flags) as server:
        yield request.param, server


def _served(server, prompt):
    result = generate(server, prompt, logprob_start=0)
    logprobs = [entry[0] for entry in result["meta_info"]["input_token_logprobs"]]
    assert len(logprobs) == len(prompt)
    return result, output_ids(result), logprobs


def test_parallel_server_equals_tp1_and_transformers(parallel_server, tiny_m3_server, tiny_m3_checkpoint):
    layout, server = parallel_server
    with open(server.log_path, encoding="utf-8", errors="replace") as handle:
        log = handle.read()
    for line in LAYOUTS[layout][1]:
        assert line in log, f"{layout}: no '{line.strip()}' in the server log"
    for label, prompt in PROMPTS.items():
        result, tokens, logprobs = _served(server, prompt)
        _, tp1_tokens, tp1_logprobs = _served(tiny_m3_server, prompt)
        assert tokens == tp1_tokens, f"{layout} {label}: greedy tokens differ from TP1"
        diff = max(abs(a - b) for a, b in zip(logprobs, tp1_logprobs) if a is not None)
        print(f"[{layout}] {label}: max |logprob - TP1| {diff:.2e}")
        assert diff <= TP_LOGPROB_TOLERANCE, f"{layout} {label}: prompt logprobs differ from TP1 by {diff}"
        assert_matches_reference(server, tiny_m3_checkpoint, prompt, f"{layout} {label}", result=result)
