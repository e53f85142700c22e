"""``sglang-m3 inspect``: the real M3 config's size, per-rank splits, and the geometry record.

Oracles: the tiny checkpoint's safetensors file (parameter count, names and shapes of the
tensors actually written by transformers), hand arithmetic from M3_FACTS s.1 (KV bytes), and
the recipe layer's per-group rule, which must reproduce the per-rank bytes of the meta build.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
from safetensors import safe_open

from sglang_m3.cli import main
from sglang_m3.inspect.report import geometry_record, inspect_config
from sglang_m3.recipe.fit import kv_bytes_per_token, weight_bytes_per_gpu
from sglang_m3.recipe.model_geometry import GEOMETRY_PATH

REAL_CONFIG = str(Path(__file__).parents[1] / "sglang_m3" / "recipe" / "data" / "m3_config.json")


@pytest.fixture(scope="module")
def tp8_ep8():
    return inspect_config(REAL_CONFIG, tp=8, ep=8, tensors=True)


@pytest.fixture(scope="module")
def tp8():
    return inspect_config(REAL_CONFIG, tp=8)


def test_real_config_size(tp8_ep8):
    params = tp8_ep8["parameters"]
    # text + vision tower; the 7 MTP modules are neither built nor loaded, so not counted
    assert params == {"total": 427_040_140_160, "text": 426_174_572_928, "vision": 865_567_232,
                      "mtp_modules": 7, "mtp_counted": False}
    # bf16: 854.08 GB, the published "BF16 ~854 GB" (M3_FACTS s.6)
    assert tp8_ep8["bytes"]["bf16"] == 854_080_280_320
    # as built, the 57 routers (128 x 6144 + 128 bias) are fp32: 2 more bytes per parameter
    assert tp8_ep8["bytes"]["as_built"] - tp8_ep8["bytes"]["bf16"] == 57 * (128 * 6144 + 128) * 2
    tensors = tp8_ep8["tensors"]
    assert sum(math.prod(shape) for shape in tensors.values()) == params["total"]
    assert tensors["language_model.model.layers.3.block_sparse_moe.experts.127.w2.weight"] == [6144, 3072]
    assert tensors["vision_tower.vision_model.encoder.layers.31.mlp.fc1.weight"] == [5120, 1280]


def test_kv_bytes_per_token_by_hand(tp8_ep8):
    # TP1: 60 layers x 2 (K, V) x 4 heads x 128 x 2 B + 57 sparse layers x 128 x 2 B
    assert tp8_ep8["kv_cache"]["kv_bytes_per_token"] == 60 * 2 * 4 * 128 * 2 == 122_880
    assert tp8_ep8["kv_cache"]["index_bytes_per_token"] == 57 * 128 * 2 == 14_592
    # TP8: one KV head per rank (each replicated on 2 ranks); the index key on every rank
    rank = tp8_ep8["per_rank"]
    assert (rank["kv_heads_per_rank"], rank["kv_head_replication"]) == (1, 2)
    assert rank["total_kv_bytes_per_token"] == 60 * 512 + 14_592 == 45_312 == kv_bytes_per_token("auto", 8, 1)


@pytest.mark.parametrize("report_name", ["tp8", "tp8_ep8"])
def test_tp8_and_ep8_split_evenly(report_name, request):
    rank = request.getfixturevalue(report_name)["per_rank"]
    assert rank["uneven"] == []
    assert len(set(rank["bytes_by_rank"])) == 1 and len(rank["bytes_by_rank"]) == 8
    ways = {group: held["split_ways"] for group, held in rank["groups"].items()}
    assert ways == {"attention_tp": 8, "kv_heads": 4, "tp": 8, "experts": 8, "replicated": 1}
    assert rank["bytes"] == 108_930_863_104


def test_expert_parallel_moves_experts_not_bytes(tp8, tp8_ep8):
    # EP8 holds 16 whole experts per rank, TP8 all 128 experts at 1/8 width: same bytes
    assert tp8["per_rank"]["groups"] == tp8_ep8["per_rank"]["groups"]


@pytest.mark.parametrize("report_name", ["tp8", "tp8_ep8"])
def test_recipe_rule_reproduces_the_meta_build(report_name, request):
    report = request.getfixturevalue(report_name)
    assert weight_bytes_per_gpu("bf16", 8, 1) == report["per_rank"]["bytes"]
    assert weight_bytes_per_gpu("bf16", 1, 1) == report["bytes"]["as_built"]


def test_recipe_rule_reproduces_the_meta_build_where_kv_heads_split():
    report = inspect_config(REAL_CONFIG, tp=2)
    assert report["per_rank"]["groups"]["kv_heads"]["split_ways"] == 2
    assert weight_bytes_per_gpu("bf16", 2, 1) == report["per_rank"]["bytes"]


def test_committed_geometry_record_is_current(tp8):
    committed = json.loads(GEOMETRY_PATH.read_text())
    assert committed == json.loads(json.dumps(geometry_record(tp8)))


def _checkpoint_shapes(directory: str) -> dict[str, list[int]]:
    """Tensor shapes of the file, in the original spelling (transformers saves a dense MLP and
    the ViT MLP under ``block_sparse_moe.``)."""
    with safe_open(f"{directory}/model.safetensors", "pt") as handle:
        return {
            re.sub(r"\.block_sparse_moe\.(gate_proj|up_proj|down_proj|fc1|fc2)\.", r".mlp.\1.", name):
                list(handle.get_slice(name).get_shape())
            for name in handle.keys()
        }


@pytest.mark.parametrize("vision", [False, True], ids=["text", "vl"])
def test_tiny_checkpoint_matches_its_safetensors(vision, tmp_path):
    from sglang_m3.tiny.checkpoint import build_tiny_checkpoint

    directory = build_tiny_checkpoint(str(tmp_path / "tiny"), vision=vision)
    shapes = _checkpoint_shapes(directory)
    report = inspect_config(directory, tp=2, ep=2, tensors=True)
    assert report["parameters"]["total"] == sum(math.prod(shape) for shape in shapes.values())
    assert report["tensors"] == shapes
    assert (report["parameters"]["vision"] > 0) == vision
    assert report["per_rank"]["uneven"] == []


def _run(capsys, *argv):
    code = main(["inspect", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def _config_with(tmp_path, edit) -> str:
    config = json.loads(Path(REAL_CONFIG).read_text())
    edit(config)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return str(path)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda c: c["text_config"].pop("moe_layer_freq"), "'moe_layer_freq' (or 'mlp_layer_types') is missing"),
        (lambda c: c["text_config"].update(hidden_act="gelu"), "'hidden_act'"),
        (lambda c: c["text_config"]["sparse_attention_config"].update(sparse_score_type="mean"), "'sparse_attention_config.sparse_score_type'"),
        (lambda c: c["vision_config"].pop("hidden_size"), "'vision_config.hidden_size'"),
    ],
    ids=["no-moe-schedule", "activation", "score-type", "vision-size"],
)
def test_bad_config_names_the_field(edit, message, tmp_path, capsys):
    code, out, err = _run(capsys, _config_with(tmp_path, edit))
    assert code == 1 and out == ""
    assert message in err and "Traceback" not in err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--tp", "3"], "num_attention_heads (64) is not divisible by --tp 3"),
        (["--tp", "8", "--ep", "3"], "--ep 3 must divide --tp 8"),
        (["--tp", "0"], "--tp and --ep must be >= 1"),
    ],
)
def test_parallel_sizes_that_do_not_divide_name_the_dimension(flags, message, capsys):
    code, out, err = _run(capsys, REAL_CONFIG, *flags)
    assert code == 1 and message in err and "Traceback" not in err


def test_experts_that_do_not_divide_over_ep(tmp_path, capsys):
    path = _config_with(tmp_path, lambda c: c["text_config"].update(num_local_experts=12))
    code, _, err = _run(capsys, path, "--tp", "8", "--ep", "8")
    assert code == 1 and "num_local_experts (12) is not divisible by --ep 8" in err


def test_missing_config_is_an_error(tmp_path, capsys):
    code, _, err = _run(capsys, str(tmp_path / "absent.json"))
    assert code == 1 and "no such file or directory" in err


@pytest.mark.parametrize("where", ["missing-folder/geometry.json", "a-directory"])
def test_write_geometry_to_an_impossible_path_names_it(where, tmp_path, capsys):
    (tmp_path / "a-directory").mkdir()
    target = str(tmp_path / where)
    code, out, err = _run(capsys, REAL_CONFIG, "--write-geometry", target)
    assert code == 1 and out == ""
    assert f"sglang-m3 inspect: --write-geometry: cannot write {target}: " in err
    assert "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-directory"]
    assert not any((tmp_path / "a-directory").iterdir())


def test_write_geometry_to_an_empty_path_is_refused(capsys):
    """``--write-geometry ''`` was taken for the option not given: exit 0, nothing written or said."""
    with pytest.raises(SystemExit) as exit_info:
        main(["inspect", REAL_CONFIG, "--write-geometry", ""])
    assert exit_info.value.code == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.endswith("sglang-m3 inspect: error: argument --write-geometry: takes the path of the file to write, got an empty one\n")


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"{not json", "not valid JSON (Expecting property name enclosed in double quotes"),
        (b"[1, 2]", "must hold a JSON object, got list"),
        (b'{"a": "\x9a\xff"}', "not UTF-8 text (invalid start byte at byte 7)"),
    ],
    ids=["malformed", "not-an-object", "not-utf8"],
)
@pytest.mark.parametrize("given", ["directory", "file"])
def test_a_config_that_cannot_be_read_is_named_in_one_line(content, message, given, tmp_path, capsys):
    """A checkpoint directory's config.json like this reached the build with a traceback
    (JSONDecodeError, AttributeError, UnicodeDecodeError), and a non-UTF-8 file named directly too."""
    (tmp_path / "config.json").write_bytes(content)
    code, out, err = _run(capsys, str(tmp_path) if given == "directory" else str(tmp_path / "config.json"))
    assert (code, out) == (1, "")
    assert err == f"sglang-m3 inspect: {tmp_path / 'config.json'}: {message}" + err.split(message, 1)[1]
    assert err.count("\n") == 1 and "Traceback" not in err


LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32}


@pytest.mark.parametrize(
    "config",
    [LLAMA, {k: v for k, v in LLAMA.items() if k != "architectures"}, {"hidden_size": 4096}],
    ids=["llama", "llama-no-architectures", "names-nothing"],
)
def test_a_config_of_another_model_is_said_not_to_be_m3(config, tmp_path, capsys):
    """It was refused as "config field 'head_dim' is missing", as if M3 with a field left out
    (and one naming no model failed in transformers with a traceback)."""
    (tmp_path / "config.json").write_text(json.dumps(config))
    code, out, err = _run(capsys, str(tmp_path))
    assert (code, out) == (1, "")
    assert err.startswith(f"sglang-m3 inspect: {tmp_path / 'config.json'}: not an M3 config (architectures ")
    assert f"model_type {config.get('model_type')!r}" in err and "MiniMaxM3SparseForCausalLM" in err
    assert err.count("\n") == 1


def test_an_m3_model_type_under_another_architecture_is_named(tmp_path, capsys):
    path = _config_with(tmp_path, lambda c: c.update(architectures=["MiniMaxM3ForEverything"]))
    code, _, err = _run(capsys, path)
    assert code == 1
    assert err.startswith(f"sglang-m3 inspect: {path}: not an M3 config (architectures ['MiniMaxM3ForEverything'], model_type 'minimax_m3_vl')")
