"""The tuned fused-MoE tile tables: lookup rule and the shipped tables' contents."""

import glob
import json
import os

import pytest

from sglang_m3.models.moe_kernel_configs import CONFIG_DIR, load_table, nearest, table_name

TILE_KEYS = {"BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K", "GROUP_SIZE_M"}


def _tuner():
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    import tune_fused_moe

    return tune_fused_moe


def test_nearest_measured_token_count_serves():
    table = {1: {"id": "one"}, 64: {"id": "sixty-four"}, 8192: {"id": "chunk"}}
    assert nearest(table, 1)["id"] == "one"
    assert nearest(table, 30)["id"] == "one"
    assert nearest(table, 40)["id"] == "sixty-four"
    assert nearest(table, 5000)["id"] == "chunk"
    assert nearest(table, 100_000)["id"] == "chunk"


def test_table_name_matches_the_keys_sglang_uses_plus_hidden_and_triton():
    name = table_name(128, 3072, 6144, "NVIDIA H100 80GB HBM3", "3.6.0")
    assert name == "E=128,N=3072,K=6144,device_name=NVIDIA_H100_80GB_HBM3,triton=3.6.0.json"


def test_a_missing_table_leaves_sglangs_choice():
    assert load_table(table_name(7, 11, 13, "no such GPU", "0.0.0")) is None


def test_a_shape_without_a_table_is_logged_once(monkeypatch, caplog):
    """A server whose per-rank expert shape has no table (e.g. a TP8 recipe) says so once, with
    the file it looked for; the shipped shapes load theirs without a word."""
    import logging

    import torch
    import triton

    from sglang_m3.models import moe_kernel_configs

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *args: "NVIDIA H200")
    monkeypatch.setattr(triton, "__version__", "3.6.0")  # the lent GPU's, which the tables name
    moe_kernel_configs._report_missing.cache_clear()  # once per process: start this one afresh
    with caplog.at_level(logging.INFO, logger=moe_kernel_configs.__name__):
        for _ in range(3):  # three MoE layers of one shape
            assert moe_kernel_configs.tile_table(128, 384, 6144) is None
        assert moe_kernel_configs.tile_table(128, 1536, 6144)  # shipped for the H200
    missing = [r.getMessage() for r in caplog.records if "no measured fused-MoE tile table" in r.getMessage()]
    assert len(missing) == 1
    assert "E=128,N=384,K=6144,device_name=NVIDIA_H200" in missing[0]


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(CONFIG_DIR, "*.json"))) or [None])
def test_shipped_tables_hold_valid_tiles(path):
    if path is None:
        pytest.skip("no tuned table shipped")
    with open(path, encoding="utf-8") as handle:
        table = json.load(handle)
    assert table, path
    for tokens, config in table.items():
        assert int(tokens) >= 1
        assert TILE_KEYS <= set(config), (path, tokens)
        for key in TILE_KEYS:
            value = config[key]
            assert value >= 1 and value & (value - 1) == 0 or key == "GROUP_SIZE_M", (path, tokens, key, value)


@pytest.mark.parametrize("ep", [1, 2, 4])
def test_tuner_routes_one_ranks_share_under_expert_parallelism(ep):
    """The tuner's routing for ``--ep``: distinct top-4 over all 128 experts, rank 0 keeps its own
    ids and sees the others' as -1, so it gets about 4/ep choices per token."""
    import torch

    TOP_K, rank_local_choices = _tuner().TOP_K, _tuner().rank_local_choices

    torch.manual_seed(ep)
    local = 128 // ep
    ids = rank_local_choices(4096, local, ep, device="cpu")
    assert ids.shape == (4096, TOP_K) and ids.dtype == torch.int32
    assert ((ids == -1) | ((ids >= 0) & (ids < local))).all()
    for row in ids.tolist():
        kept = [i for i in row if i >= 0]
        assert len(kept) == len(set(kept))
    kept_share = (ids >= 0).float().mean().item()
    assert abs(kept_share - 1 / ep) < 0.03


def test_a_report_that_came_back_installs_its_table(tmp_path):
    """The device returns the tuner's report but not its table file (named with '=' and ','):
    ``--install-report`` writes the table the report carries to the path it names."""
    table = {"1": {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 32, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 1}}
    report = tmp_path / "report.json"
    report.write_text(json.dumps({"table": table, "installed_as": "configs/E=64,N=3072,device_name=X.json"}))
    target = _tuner().install_report(str(report), str(tmp_path / "repo"))
    assert target == str(tmp_path / "repo" / "configs" / "E=64,N=3072,device_name=X.json")
    assert json.loads(open(target).read()) == table


@pytest.mark.parametrize("report, message", [
    ({"rows": []}, "no 'table'"),
    ({"table": {}, "installed_as": "../outside.json"}, "leaves the repository"),
])
def test_a_report_without_a_safe_table_is_refused(tmp_path, report, message):
    path = tmp_path / "report.json"
    path.write_text(json.dumps(report))
    with pytest.raises(SystemExit, match=message):
        _tuner().install_report(str(path), str(tmp_path / "repo"))
    assert not (tmp_path / "outside.json").exists()


def test_the_tuner_refuses_tp_with_ep_and_needs_out_to_tune(capsys):
    with pytest.raises(SystemExit):
        _tuner().main(["--out", "x", "--tp", "2", "--ep", "2"])
    assert "--tp and --ep are exclusive" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _tuner().main([])
    assert "--out is required" in capsys.readouterr().err


def test_tma_doubles_the_candidates_with_use_tma_set():
    tuner = _tuner()
    for tokens in (1, 256, 8192):
        plain, both = tuner.candidates(tokens), tuner.candidates(tokens, tma=True)
        assert all("USE_TMA" not in tile for tile in plain)
        assert both[: len(plain)] == plain and both[len(plain):] == [{**tile, "USE_TMA": True} for tile in plain]


def test_the_tuner_keeps_the_shared_slot_to_ours_without_expert_parallelism(capsys):
    for flags in (["--ep", "2"], ["--upstream"]):
        with pytest.raises(SystemExit):
            _tuner().main(["--out", "x", "--shared-slot", *flags])
        assert "--shared-slot is ours' shape without expert parallelism" in capsys.readouterr().err
