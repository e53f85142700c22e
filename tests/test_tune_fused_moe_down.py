"""The down-projection tuner's pieces that need no GPU: its candidates, and that SGLang's own
table lookup sees exactly the tables it writes (the timing itself runs on the device only)."""

import os
import subprocess
import sys
import textwrap

import pytest

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
sys.path.insert(0, BENCHMARKS)

from tune_fused_moe import candidates  # noqa: E402
from tune_fused_moe_down import down_candidates  # noqa: E402


@pytest.mark.parametrize("tokens, block_m", [(1, 16), (256, 64), (8192, 128)])
def test_down_tiles_share_the_up_tiles_block_m_and_come_with_and_without_tma(tokens, block_m):
    tiles = down_candidates(tokens, block_m)
    assert {tile["BLOCK_SIZE_M"] for tile in tiles} == {block_m}
    keys = [tuple(sorted(tile.items())) for tile in tiles]
    assert len(keys) == len(set(keys))
    with_tma = [tile for tile in tiles if tile["USE_TMA"]]
    assert len(with_tma) * 2 == len(tiles)
    rest = lambda tile: {k: v for k, v in tile.items() if k not in ("BLOCK_SIZE_M", "USE_TMA")}  # noqa: E731
    assert {tuple(sorted(rest(t).items())) for t in tiles} == {tuple(sorted(rest(t).items())) for t in candidates(tokens)}


LOOKUP = textwrap.dedent("""
    import json, os, sys, tempfile, triton
    sys.path.insert(0, sys.argv[1])
    from midsize_m3 import write_midsize_checkpoint
    from tune_fused_moe import publish_single_rank
    from tune_fused_moe_down import sglang_lookup
    import sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe_triton_config as tables

    publish_single_rank(write_midsize_checkpoint(tempfile.mkdtemp(), 1, 3))
    tables.get_device_name = lambda: "NVIDIA H100 80GB HBM3"  # no GPU here: the name SGLang keys on
    up, down = {"1": {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 32}}, {"1": {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 64, "USE_TMA": True}}
    folder, seen = tempfile.mkdtemp(), {}
    with sglang_lookup(folder, triton.__version__, 64, 3072, up, down):
        seen["both"] = [tables.get_moe_configs(64, 3072, None), tables.get_moe_configs(64, 3072, None, down_moe=True)]
    with sglang_lookup(folder, triton.__version__, 64, 3072, up, None):
        seen["no_down"] = tables.get_moe_configs(64, 3072, None, down_moe=True)
    seen["env_after"] = os.environ.get("SGLANG_MOE_CONFIG_DIR")
    print("SEEN" + json.dumps(seen))
""")


def test_sglangs_lookup_sees_the_written_tables_and_falls_back_without_a_down_file():
    """In a child process: publishing SGLang's runtime context for the lookup is process-wide."""
    import json

    env = {k: v for k, v in os.environ.items() if k != "SGLANG_MOE_CONFIG_DIR"}
    done = subprocess.run([sys.executable, "-c", LOOKUP, BENCHMARKS], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.split("SEEN", 1)[1])
    assert seen["both"] == [{"1": {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 32}}, {"1": {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 64, "USE_TMA": True}}]
    # without the down file SGLang reuses the up table (what the tuner's baseline measures)
    assert seen["no_down"] == {"1": {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 32}}
    assert seen["env_after"] is None
