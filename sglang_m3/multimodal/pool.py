"""A bounded worker pool for decoding and resizing, so the tokenizer's event loop never blocks.

At most ``workers`` media are processed at once and at most ``max_pending`` are admitted
(running or queued); further media wait for room (back-pressure) instead of growing memory.
Decoders (PIL, PyAV/FFmpeg) and torch release the GIL, so the threads run in parallel; each
worker keeps torch to one intra-op thread, so the pool width alone sets the CPU use (threads
otherwise start with torch's default of one OpenMP thread per core and oversubscribe).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch

T = TypeVar("T")


class MediaWorkerPool:
    def __init__(self, workers: int = 4, max_pending: int = 64):
        if workers < 1 or max_pending < workers:
            raise ValueError(f"need workers >= 1 and max_pending >= workers, got {workers}, {max_pending}")
        self.workers = workers
        self.max_pending = max_pending
        self._executor = ThreadPoolExecutor(
            max_workers=workers, thread_name_prefix="m3-media", initializer=torch.set_num_threads, initargs=(1,)
        )
        self._admitted: asyncio.Semaphore | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def run(self, fn: Callable[..., T], *args) -> T:
        """Awaits ``fn(*args)`` on a worker thread, after waiting for an admission slot.

        Admission is counted per event loop (SGLang's tokenizer manager runs one).
        """
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            self._admitted, self._loop = asyncio.Semaphore(self.max_pending), loop
        async with self._admitted:
            return await loop.run_in_executor(self._executor, fn, *args)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
