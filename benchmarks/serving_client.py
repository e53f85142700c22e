"""Client-side serving measurements over SGLang's native ``/generate`` with token ids.

Every request streams, so one request gives its time to first token (TTFT) and its time per
output token after the first (TPOT); a group of requests sent at once gives the output
throughput (all output tokens over the wall time from the first send to the last token). Token
ids in, token ids out: the servers run with ``--skip-tokenizer-init`` and random weights, so text
would mean nothing and tokenization would only add client noise. ``ignore_eos`` keeps every
request at its requested length.
"""

from __future__ import annotations

import json
import random
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import requests

#: Token ids drawn for prompts: clear of the special tokens at the top of M3's vocabulary.
PROMPT_ID_RANGE = (1000, 150000)


@dataclass(frozen=True)
class RequestTiming:
    ttft_s: float
    latency_s: float
    output_tokens: int

    @property
    def tpot_s(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.latency_s - self.ttft_s) / (self.output_tokens - 1)


@dataclass(frozen=True)
class GroupTiming:
    requests: list[RequestTiming]
    wall_s: float

    @property
    def output_tok_s(self) -> float:
        return sum(r.output_tokens for r in self.requests) / self.wall_s

    @property
    def mean_tpot_ms(self) -> float:
        return 1e3 * statistics.mean(r.tpot_s for r in self.requests if r.tpot_s is not None)

    @property
    def mean_ttft_ms(self) -> float:
        return 1e3 * statistics.mean(r.ttft_s for r in self.requests)


def random_prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(*PROMPT_ID_RANGE) for _ in range(length)]


def stream_generate(base_url: str, input_ids: list[int], max_new_tokens: int, timeout_s: float = 900.0) -> RequestTiming:
    """One streamed greedy request; raises with the server's answer when it is not a success."""
    payload = {
        "input_ids": input_ids,
        "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True},
        "stream": True,
    }
    start = time.perf_counter()
    first = None
    last_meta = None
    with requests.post(f"{base_url}/generate", json=payload, stream=True, timeout=timeout_s) as response:
        if response.status_code != 200:
            raise RuntimeError(f"/generate answered {response.status_code}: {response.text[:500]}")
        for line in response.iter_lines():
            if not line.startswith(b"data:"):
                continue
            body = line[5:].strip()
            if body == b"[DONE]":
                break
            chunk = json.loads(body)
            if "error" in chunk:
                raise RuntimeError(f"/generate streamed an error: {chunk['error']}")
            if first is None:
                first = time.perf_counter()
            last_meta = chunk.get("meta_info", last_meta)
    end = time.perf_counter()
    if first is None or last_meta is None:
        raise RuntimeError("/generate streamed no tokens")
    return RequestTiming(first - start, end - start, int(last_meta["completion_tokens"]))


def run_group(base_url: str, prompts: list[list[int]], max_new_tokens: int) -> GroupTiming:
    """All ``prompts`` sent at once (concurrency = their number)."""
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
        timings = list(pool.map(lambda ids: stream_generate(base_url, ids, max_new_tokens), prompts))
    return GroupTiming(timings, time.perf_counter() - start)


def single_stream_tpot_ms(base_url: str, prompts: list[list[int]], max_new_tokens: int) -> list[float]:
    """TPOT of each prompt sent alone, one after another. One request's TPOT varied by up to 40%
    between otherwise identical runs on the H100 (2.5 vs 3.3-3.6 ms), so concurrency 1 is
    reported as the median of several."""
    return [1e3 * stream_generate(base_url, ids, max_new_tokens).tpot_s for ids in prompts]
