"""The worker pool bounds concurrency and admission and keeps results in order."""

import asyncio
import threading
import time

import pytest

from sglang_m3.multimodal.pool import MediaWorkerPool


def test_concurrency_is_bounded_and_results_keep_order():
    pool = MediaWorkerPool(workers=2, max_pending=3)
    lock, active, peak = threading.Lock(), [0], [0]

    def job(i):
        with lock:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
        time.sleep(0.02)
        with lock:
            active[0] -= 1
        return i * i

    async def main():
        return await asyncio.gather(*(pool.run(job, i) for i in range(10)))

    assert asyncio.run(main()) == [i * i for i in range(10)]
    assert peak[0] == 2
    pool.shutdown()


def test_admission_waits_instead_of_queueing_without_bound():
    pool = MediaWorkerPool(workers=1, max_pending=2)
    release = threading.Event()

    async def main():
        first = [asyncio.ensure_future(pool.run(release.wait)) for _ in range(2)]
        third = asyncio.ensure_future(pool.run(lambda: "third"))
        await asyncio.sleep(0.05)
        assert pool._admitted.locked() and not third.done()
        release.set()
        return await asyncio.gather(*first, third)

    assert asyncio.run(main()) == [True, True, "third"]
    pool.shutdown()


def test_errors_come_back_to_the_caller():
    pool = MediaWorkerPool(workers=1, max_pending=1)

    def fail():
        raise ValueError("bad")

    with pytest.raises(ValueError, match="bad"):
        asyncio.run(pool.run(fail))
    pool.shutdown()


def test_invalid_sizes_are_refused():
    with pytest.raises(ValueError, match="max_pending >= workers"):
        MediaWorkerPool(workers=4, max_pending=2)
