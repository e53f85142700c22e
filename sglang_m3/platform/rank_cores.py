"""CPU cores for each rank of a multi-rank server on the CPU platform.

SGLang 0.5.23 binds every rank of a ``device == "cpu"`` server to CPU cores before it builds the
process groups (``bootstrap._bind_threads_if_cpu`` -> ``numa_utils.init_threads_binding``). Unless
``SGLANG_CPU_OMP_THREADS_BIND`` names each rank's cores, it gives each rank one NUMA node and
asserts ``dp * tp * pp <= NUMA nodes``: on a one-node machine (any laptop or CI runner)
``--tp-size 2`` dies there, before any model code runs. The binding itself is applied only by
sgl_kernel's CPU engine, which this platform does not use; what remains is the assertion, and the
thread count each rank should take so that ranks do not oversubscribe the cores they share.

So, for a server with more ranks than NUMA nodes and no explicit choice, the platform splits the
process's physical cores into one contiguous group per rank (in NUMA-node order, SGLang's own
per-node lists) and sets ``OMP_NUM_THREADS`` to a group's size; both are read by the scheduler
processes, which start after the platform's server-argument defaults ran. An explicit
``SGLANG_CPU_OMP_THREADS_BIND`` or ``OMP_NUM_THREADS`` is left alone.
"""

from __future__ import annotations

import logging
import os
from typing import MutableMapping

logger = logging.getLogger(__name__)

BIND_ENV = "SGLANG_CPU_OMP_THREADS_BIND"
THREADS_ENV = "OMP_NUM_THREADS"


def rank_core_groups(cores_by_node: list[list[int]], ranks: int) -> list[list[int]]:
    """``ranks`` contiguous groups of the cores (node order); with fewer cores than ranks, rank
    ``i`` shares core ``i mod cores``."""
    cores = [core for node in cores_by_node for core in node]
    if not cores:
        raise ValueError("no CPU core is available to this process")
    if len(cores) < ranks:
        return [[cores[i % len(cores)]] for i in range(ranks)]
    size, extra = divmod(len(cores), ranks)
    groups, start = [], 0
    for i in range(ranks):
        end = start + size + (i < extra)
        groups.append(cores[start:end])
        start = end
    return groups


def assign_rank_cores(server_args, env: MutableMapping[str, str] = os.environ) -> None:
    """Set ``SGLANG_CPU_OMP_THREADS_BIND`` / ``OMP_NUM_THREADS`` for a server with more ranks than
    NUMA nodes (see the module docstring); nothing for one rank or an explicit choice."""
    ranks = server_args.dp_size * server_args.tp_size * server_args.pp_size
    if ranks <= 1 or env.get(BIND_ENV):
        return
    from sglang.srt.utils.common import get_cpu_ids_by_node

    cores_by_node = [[int(core) for core in node.split(",")] for node in get_cpu_ids_by_node()]
    if ranks <= len(cores_by_node):
        return  # SGLang's default: one NUMA node per rank
    groups = rank_core_groups(cores_by_node, ranks)
    env[BIND_ENV] = "|".join(",".join(map(str, group)) for group in groups)
    env.setdefault(THREADS_ENV, str(min(len(group) for group in groups)))
    logger.info(
        "%d ranks on %d NUMA node(s): %s=%s, %s=%s",
        ranks, len(cores_by_node), BIND_ENV, env[BIND_ENV], THREADS_ENV, env[THREADS_ENV],
    )
