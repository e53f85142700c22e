"""What the sparse-offload tests share: a paged ``req_to_token`` double and the served counters.

``PagedRequests`` hands out shuffled whole pages as SGLang's paged allocator does
(``slot % block == position % block``), request 1 starting with request 0's first pages (a radix
hit: the same slots); page 0 is the padding page, never handed out. ``counters`` reads the last
block-cache totals a sparse-offload server logged.
"""

from __future__ import annotations

import re

import torch


class PagedRequests:
    def __init__(self, pool_slots: int, block: int, width: int, shared_pages: int, generator, rows: int = 3,
                 spare_rows: int = 0):
        self.block = block
        self.free = (torch.randperm(pool_slots // block - 1, generator=generator) + 1).tolist()  # page 0: padding
        self.req_to_token = torch.zeros(rows + spare_rows, width, dtype=torch.int64)  # spare rows stay padding
        self.lens = [0] * rows
        self.shared_pages = shared_pages

    def grow(self, req: int, tokens: int) -> None:
        block = self.block
        for position in range(self.lens[req], self.lens[req] + tokens):
            if position % block == 0:
                shared = req == 1 and position < self.shared_pages * block
                page = int(self.req_to_token[0, position]) // block if shared else self.free.pop()
                self.req_to_token[req, position : position + block] = torch.arange(block) + page * block
        self.lens[req] += tokens


COUNTER_LINE = re.compile(r"M3 sparse offload after (\d+) decode/verify steps: block-cache hits (\d+), misses (\d+).*"
                          r"host->device (\d+) bytes")


def counters(log: str) -> dict[str, int]:
    """The last block-cache totals in a server's log text (zeros before its first logged step)."""
    lines = COUNTER_LINE.findall(log)
    steps, hits, misses, h2d = map(int, lines[-1]) if lines else (0, 0, 0, 0)
    return {"steps": steps, "hits": hits, "misses": misses, "h2d_bytes": h2d}


def output_logprobs(result) -> list[float]:
    return [entry[0] for entry in result["meta_info"]["output_token_logprobs"]]
