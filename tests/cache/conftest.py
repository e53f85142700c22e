"""Host pools built in-process here are checked against a fixed host-memory budget.

SGLang sizes a HiCache host pool against the machine's available RAM minus a 10 GiB reserve. On
the 24 GB CI machine a server test on the other worker can push that below zero, and SGLang then
refuses even these kilobyte pools ("only have -0.13 GB free"). Its own snapshot scope
(``host_memory_budget_scope``) pins the budget, so the tests do not depend on what else runs;
a pool past the budget is still refused with SGLang's message.
"""

import pytest
from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope

#: More than any pool these tests build (1 GB at most), far less than the refused 100,000 GB.
HOST_MEMORY_BUDGET_BYTES = 4 << 30


@pytest.fixture(autouse=True)
def fixed_host_memory_budget():
    with host_memory_budget_scope(HOST_MEMORY_BUDGET_BYTES):
        yield
