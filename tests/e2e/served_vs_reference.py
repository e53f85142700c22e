"""Requests to a served tiny M3 and their comparison with transformers' M3 (the oracle)."""

from __future__ import annotations

import requests
from transformers_oracle import greedy_tokens, prompt_logprobs

NEW_TOKENS = 12
LOGPROB_TOLERANCE = 2e-3


def generate(server, prompt_ids, max_new_tokens=NEW_TOKENS, logprob_start=None):
    body = {"input_ids": prompt_ids, "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": True}}
    if logprob_start is not None:
        body.update(return_logprob=True, logprob_start_len=logprob_start)
    response = requests.post(f"{server.base_url}/generate", json=body, timeout=600)
    response.raise_for_status()
    return response.json()


def output_ids(result) -> list[int]:
    return result["output_ids"] if "output_ids" in result else [t[1] for t in result["meta_info"]["output_token_logprobs"]]


def logprob_diff(result, model_dir, prompt) -> float:
    """Largest |served - transformers| prompt logprob over the positions the server returned.

    The server returns entries for positions ``logprob_start_len .. len-1`` (the first one has no
    logprob when it is position 0); they line up with the end of transformers' list.
    """
    entries = result["meta_info"]["input_token_logprobs"]
    start = len(prompt) - len(entries)
    assert [t[1] for t in entries] == prompt[start:], "served logprob entries do not line up with the prompt"
    served = [(start + i, t[0]) for i, t in enumerate(entries) if t[0] is not None]
    assert served, "no prompt logprobs served"
    reference = prompt_logprobs(model_dir, prompt)
    return max(abs(value - reference[position - 1].item()) for position, value in served)


def assert_matches_reference(server, model_dir, prompt, label, result=None, logprob_start=0):
    result = result or generate(server, prompt, logprob_start=logprob_start)
    assert output_ids(result) == greedy_tokens(model_dir, prompt, NEW_TOKENS), f"greedy continuation of {label} differs"
    diff = logprob_diff(result, model_dir, prompt)
    print(f"[logprob] {label}: max |diff| {diff:.2e}")
    assert diff < LOGPROB_TOLERANCE, f"prompt logprobs of {label} differ by {diff}"
    return result
