"""``sglang-m3 inspect``'s decode floor: what one lone request's decode step must read per rank.

The floor is counted from the model classes built on the meta device. Its oracle here is a hand
count from the config's fields alone (the formula the e2e report used before the floor moved into
inspect): the lm head split over TP, one embedding row, each layer's projections with KV heads
replicated beyond their count, the index projections whole, ``k`` experts and the shared experts
split over TP, the fp32 router, and the cache of the selected blocks. The two must agree but for
the norms' weights, which the hand count leaves out (kilobytes).
"""

from __future__ import annotations

import json
import math
import os
import sys

import pytest

from sglang_m3.cli import main
from sglang_m3.inspect.decode_floor import FloorContextError, peak_bandwidth
from sglang_m3.inspect.report import inspect_config

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
from midsize_m3 import midsize_text_config  # noqa: E402

REAL_CONFIG = os.path.join(os.path.dirname(__file__), "..", "sglang_m3", "recipe", "data", "m3_config.json")
BF16, FP32 = 2, 4
NORMS_AT_MOST = 10**6


def hand_count(model: dict, tp: int, context: int) -> int:
    """Bytes of one decode step on one rank of a ``tp``-way server, from the config's fields."""
    hidden, head_dim = model["hidden_size"], model["head_dim"]
    q_width = model["num_attention_heads"] * head_dim // tp
    kv_width = max(1, model["num_key_value_heads"] // tp) * head_dim
    sparse = model["sparse_attention_config"]
    selected = min(context, sparse["sparse_topk_blocks"] * sparse["sparse_block_size"])
    total = model["vocab_size"] * hidden * BF16 // tp + hidden * BF16
    for is_sparse, is_moe in zip(sparse["sparse_attention_freq"], model["moe_layer_freq"]):
        total += (hidden * (q_width + 2 * kv_width) + q_width * hidden) * BF16
        if is_sparse:
            total += hidden * (sparse["sparse_num_index_heads"] + 1) * sparse["sparse_index_dim"] * BF16
            total += context * sparse["sparse_index_dim"] * BF16 + selected * 2 * kv_width * BF16
        else:
            total += context * 2 * kv_width * BF16
        if is_moe:
            total += model["num_experts_per_tok"] * 3 * hidden * model["intermediate_size"] * BF16 // tp
            total += model["n_shared_experts"] * 3 * hidden * model["shared_intermediate_size"] * BF16 // tp
            total += hidden * model["num_local_experts"] * FP32 + model["num_local_experts"] * FP32
        else:
            total += 3 * hidden * model["dense_intermediate_size"] * BF16 // tp
    return total


def write_config(directory, config: dict) -> str:
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w", encoding="utf-8") as handle:
        json.dump(config, handle)
    return str(directory)


def floor_of(directory: str, tp: int = 1, ep: int = 1, context: int = 2048) -> dict:
    return inspect_config(directory, tp, ep, context=context)["per_rank"]["decode_floor"]


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
@pytest.mark.parametrize("context", [1, 2048, 32768])
def test_the_built_floor_is_the_hand_count_but_for_the_norms(tmp_path, tp, context):
    """TP8 splits the 4 KV heads no further (each replicated on 2 ranks); at 1 token a sparse
    layer's selection is the whole context, at 32K it is 16 blocks of 128 tokens."""
    model = midsize_text_config(1, 3)
    floor = floor_of(write_config(tmp_path, model), tp, context=context)
    assert 0 <= floor["bf16"]["total"] - hand_count(model, tp, context) < NORMS_AT_MOST


def test_a_longer_context_adds_all_its_tokens_on_dense_layers_and_only_index_keys_on_sparse(tmp_path):
    model = midsize_text_config(1, 3)
    directory = write_config(tmp_path, model)
    short, long = floor_of(directory, context=2048)["bf16"], floor_of(directory, context=32768)["bf16"]
    kv_token = 2 * model["num_key_value_heads"] * model["head_dim"] * BF16
    assert long["kv_cache"] - short["kv_cache"] == 1 * 30720 * kv_token  # the one dense layer
    assert long["index_keys"] == 16 * short["index_keys"]
    assert {k: v for k, v in long.items() if k not in ("kv_cache", "index_keys", "total")} == {
        k: v for k, v in short.items() if k not in ("kv_cache", "index_keys", "total")
    }


@pytest.mark.parametrize("chosen", [3, 4])
def test_expert_parallel_counts_the_chosen_experts_the_busiest_rank_must_hold(tmp_path, chosen):
    """Under EP2 some rank holds at least ceil(k / 2) of a token's k experts, whole; under TP2
    every rank holds half of each of the k: the same bytes when k is even, a third more for k = 3."""
    model = {**midsize_text_config(1, 3), "num_experts_per_tok": chosen}
    directory = write_config(tmp_path, model)
    tp2, ep2 = floor_of(directory, 2, 1), floor_of(directory, 2, 2)
    assert ep2["chosen_experts_per_moe_layer"] == math.ceil(chosen / 2)
    expert = 3 * model["hidden_size"] * model["intermediate_size"] * BF16
    assert ep2["bf16"]["chosen_experts"] == 3 * math.ceil(chosen / 2) * expert
    assert tp2["bf16"]["chosen_experts"] == 3 * chosen * expert // 2
    assert {k: v for k, v in ep2["bf16"].items() if k not in ("chosen_experts", "total")} == {
        k: v for k, v in tp2["bf16"].items() if k not in ("chosen_experts", "total")
    }


def test_the_shipped_model_at_tp8_ep8(tmp_path):
    """The real config: 57 MoE layers, one whole chosen expert on the busiest of 8 ranks (k = 4),
    each expert 6144 x (2 x 3072) + 3072 x 6144 bf16 weights; 1/8 of the 200,064 x 6144 lm head."""
    floor = floor_of(REAL_CONFIG, 8, 8)
    assert floor["chosen_experts_per_moe_layer"] == 1
    assert floor["bf16"]["chosen_experts"] == 57 * 3 * 6144 * 3072 * BF16
    assert floor["bf16"]["lm_head"] - 200_064 * 6144 * BF16 // 8 < NORMS_AT_MOST
    # the MXFP8 checkpoint stores experts as e4m3 plus one e8m0 scale per 32 elements
    assert floor["mxfp8"]["chosen_experts"] == 57 * (3 * 6144 * 3072) * 33 // 32
    assert floor["mxfp8"]["lm_head"] == floor["bf16"]["lm_head"] and floor["mxfp8"]["kv_cache"] == floor["bf16"]["kv_cache"]
    assert floor["ms_per_token"]["h200"]["bf16"] == pytest.approx(1e3 * floor["bf16"]["total"] / 4.8e12)
    assert floor["ms_per_token"]["mi300x"]["mxfp8"] == pytest.approx(1e3 * floor["mxfp8"]["total"] / 5.3e12)


def test_the_vision_tower_is_not_read_while_decoding_text(tmp_path):
    from sglang_m3.tiny.checkpoint import build_tiny_checkpoint

    text = floor_of(build_tiny_checkpoint(str(tmp_path / "text"), vision=False))
    vl = floor_of(build_tiny_checkpoint(str(tmp_path / "vl"), vision=True))
    assert vl["bf16"] == text["bf16"]


def test_a_tied_lm_head_reads_the_whole_embedding_table_and_no_row_besides(tmp_path):
    model = midsize_text_config(1, 3)
    untied = floor_of(write_config(tmp_path / "untied", model))["bf16"]
    tied = floor_of(write_config(tmp_path / "tied", {**model, "tie_word_embeddings": True}))["bf16"]
    table = model["vocab_size"] * model["hidden_size"] * BF16
    assert untied["embedding_row"] == model["hidden_size"] * BF16 and tied["embedding_row"] == 0
    assert tied["lm_head"] == untied["lm_head"] and tied["lm_head"] - table < NORMS_AT_MOST


def test_peak_bandwidth_by_the_device_name_torch_reports():
    assert peak_bandwidth("NVIDIA H200") == 4.8e12
    assert peak_bandwidth("NVIDIA H100 80GB HBM3") == 3.35e12
    assert peak_bandwidth("NVIDIA B300 SXM6 AC") == 8.0e12
    assert peak_bandwidth("AMD Instinct MI300X") == 5.3e12
    # other parts of a family are not the catalog's: no borrowed rate
    assert peak_bandwidth("NVIDIA H100 PCIe") is None
    assert peak_bandwidth("NVIDIA H100 NVL") is None
    assert peak_bandwidth("NVIDIA A100-SXM4-80GB") is None


def test_every_gpu_profile_a_recipe_may_name_gets_a_floor_time(tmp_path):
    from sglang_m3.recipe.catalog import CATALOG

    floor = floor_of(write_config(tmp_path, midsize_text_config(1, 3)))
    gpus = {name for name, profile in CATALOG.items() if profile.is_gpu}
    assert set(floor["ms_per_token"]) == gpus
    for name in gpus:
        assert floor["ms_per_token"][name]["bf16"] == pytest.approx(1e3 * floor["bf16"]["total"] / (CATALOG[name].hbm_tbps * 1e12))


@pytest.mark.parametrize("context", [0, 1_048_577])
def test_a_context_outside_the_model_is_refused_naming_its_bounds(tmp_path, context):
    directory = write_config(tmp_path, midsize_text_config(1, 3))
    with pytest.raises(FloorContextError, match="max_position_embeddings"):
        inspect_config(directory, context=context)


def test_cli_prints_the_floor_and_refuses_a_bad_context(tmp_path, capsys):
    directory = write_config(tmp_path, midsize_text_config(1, 3))
    assert main(["inspect", directory, "--tp", "2", "--context", "4096", "--json"]) == 0
    floor = json.loads(capsys.readouterr().out)["per_rank"]["decode_floor"]
    assert floor["context"] == 4096
    assert main(["inspect", directory, "--tp", "2", "--context", "4096"]) == 0
    out = capsys.readouterr().out
    assert "decode floor, one lone request at 4,096 tokens of context" in out
    assert f"{floor['bf16']['total'] / 1e9:.3f}" in out
    assert f"h200    4.80 TB/s  >= {floor['ms_per_token']['h200']['bf16']:.3f} ms per token at bf16" in out
    assert main(["inspect", directory, "--context", "2000000"]) == 1
    assert "--context" in capsys.readouterr().err
    with pytest.raises(SystemExit) as refused:
        main(["inspect", directory, "--context", "many"])
    assert refused.value.code == 2 and "--context" in capsys.readouterr().err
