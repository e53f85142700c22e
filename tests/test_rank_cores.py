"""Cores and threads per rank for multi-rank servers on the CPU platform (sglang_m3.platform.rank_cores):
without them SGLang 0.5.23 refuses ``--tp-size 2`` on a one-NUMA-node machine."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from sglang_m3.platform.rank_cores import BIND_ENV, THREADS_ENV, assign_rank_cores, rank_core_groups


def _args(tp=1, dp=1, pp=1):
    return SimpleNamespace(tp_size=tp, dp_size=dp, pp_size=pp)


@pytest.mark.parametrize(
    "nodes, ranks, groups",
    [
        ([[0, 1]], 2, [[0], [1]]),
        ([[0, 1, 2, 3, 4]], 2, [[0, 1, 2], [3, 4]]),
        ([[0, 1], [2, 3]], 4, [[0], [1], [2], [3]]),
        ([[0, 1, 2, 3], [4, 5, 6, 7]], 4, [[0, 1], [2, 3], [4, 5], [6, 7]]),
        ([[0]], 2, [[0], [0]]),  # fewer cores than ranks: shared
        ([[5, 7]], 3, [[5], [7], [5]]),
    ],
)
def test_groups_split_the_cores_in_node_order(nodes, ranks, groups):
    assert rank_core_groups(nodes, ranks) == groups


def test_no_core_is_refused():
    with pytest.raises(ValueError, match="no CPU core"):
        rank_core_groups([], 2)


def _patch_nodes(monkeypatch, nodes):
    import sglang.srt.utils.common as common

    monkeypatch.setattr(common, "get_cpu_ids_by_node", lambda: [",".join(map(str, node)) for node in nodes])


def test_more_ranks_than_nodes_get_their_cores_and_threads(monkeypatch):
    _patch_nodes(monkeypatch, [[0, 1, 2, 3]])
    env: dict[str, str] = {}
    assign_rank_cores(_args(tp=2), env)
    assert env == {BIND_ENV: "0,1|2,3", THREADS_ENV: "2"}
    env = {}
    assign_rank_cores(_args(tp=2, dp=2), env)  # dp * tp * pp ranks, SGLang's count
    assert env == {BIND_ENV: "0|1|2|3", THREADS_ENV: "1"}


def test_explicit_choices_and_sglang_defaults_are_left_alone(monkeypatch):
    _patch_nodes(monkeypatch, [[0, 1], [2, 3]])
    for args, env in [
        (_args(tp=1), {}),  # one rank: no binding check
        (_args(tp=2), {}),  # one NUMA node per rank: SGLang's own default
        (_args(tp=4), {BIND_ENV: "0-1|2-3|0-1|2-3"}),  # explicit binding
    ]:
        before = dict(env)
        assign_rank_cores(args, env)
        assert env == before
    env = {THREADS_ENV: "7"}
    assign_rank_cores(_args(tp=4), env)
    assert env == {BIND_ENV: "0|1|2|3", THREADS_ENV: "7"}  # an explicit thread count stays


def test_the_platform_assigns_them(monkeypatch):
    import sglang  # noqa: F401  (SGLang first, as in every SGLang process: see test_platform_activation)

    from sglang_m3.platform.cpu_platform import TorchNativeCpuPlatform

    _patch_nodes(monkeypatch, [[0, 1]])
    monkeypatch.delenv(BIND_ENV, raising=False)
    monkeypatch.delenv(THREADS_ENV, raising=False)
    args = SimpleNamespace(device=None, sampling_backend=None, attention_backend=None, prefill_attention_backend=None,
                           decode_attention_backend=None, **vars(_args(tp=2)))
    TorchNativeCpuPlatform().apply_server_args_defaults(args)  # monkeypatch restores the environment
    assert (os.environ[BIND_ENV], os.environ[THREADS_ENV]) == ("0|1", "1")
