"""Greedy generation through SGLang's native ``/generate`` endpoint, with its speculative counters."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import requests


def generate(base_url: str, prompt_ids: list[int], max_new_tokens: int, logprobs: bool = False) -> dict:
    """``{"output_ids", "meta_info"}`` of one greedy request (EOS ignored, so lengths are fixed);
    with ``logprobs`` the meta info carries ``output_token_logprobs``."""
    response = requests.post(
        f"{base_url}/generate",
        json={
            "input_ids": prompt_ids,
            "return_logprob": logprobs,
            "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": True},
        },
        timeout=600,
    )
    response.raise_for_status()
    body = response.json()
    return {"output_ids": body["output_ids"], "meta_info": body["meta_info"]}


def generate_concurrently(base_url: str, prompts: list[list[int]], max_new_tokens: int) -> list[dict]:
    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda p: generate(base_url, p, max_new_tokens), prompts))


def accept_length(results: list[dict]) -> float:
    """Tokens committed per verify step over several requests (SGLang counts the bonus token)."""
    tokens = sum(len(r["output_ids"]) for r in results)
    steps = sum(r["meta_info"]["spec_verify_ct"] for r in results)
    return tokens / steps
