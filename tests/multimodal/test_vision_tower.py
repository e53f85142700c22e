"""Our vision tower + projector + patch merge against transformers' MiniMaxM3VLModel."""

import copy
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers.models.minimax_m3_vl.modeling_minimax_m3_vl import MiniMaxM3SparseForConditionalGeneration

from sglang_m3.models.vision import MiniMaxM3VisionEncoder
from tests.multimodal.tiny_vl import tiny_vl_config

PATCH_DIM = 3 * 2 * 14 * 14


def saved_checkpoint(tmp_path: Path, config) -> tuple[MiniMaxM3SparseForConditionalGeneration, dict]:
    """A random transformers model and the tensors its save_pretrained wrote (checkpoint names)."""
    torch.manual_seed(0)
    model = MiniMaxM3SparseForConditionalGeneration(config).eval()
    with torch.no_grad():  # the default init zeroes biases and norms; randomise everything
        for param in model.parameters():
            param.normal_(0.0, 0.2)
    model.save_pretrained(tmp_path)
    return model, load_file(tmp_path / "model.safetensors")


def reference_rows(model, pixel_values, grids) -> torch.Tensor:
    """Transformers' features, one call per media item (its attention spans a whole call)."""
    rows, start = [], 0
    for grid in grids:
        count = int(torch.tensor(grid).prod())
        out = model.model.get_image_features(pixel_values[start : start + count], torch.tensor([grid]))
        rows.append(torch.cat(out.pooler_output))
        start += count
    return torch.cat(rows)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    config = tiny_vl_config()
    model, tensors = saved_checkpoint(tmp_path_factory.mktemp("ckpt"), config)
    ours = MiniMaxM3VisionEncoder(config)
    ours.load_weights(tensors.items())
    return model, ours.eval(), tensors


@pytest.mark.parametrize(
    "grids",
    [
        [[1, 2, 2]],
        [[1, 4, 6]],
        [[1, 6, 2], [1, 2, 4]],
        [[3, 4, 4]],
        [[1, 2, 2], [2, 4, 2], [1, 8, 6]],
    ],
)
def test_matches_transformers(pair, grids):
    model, ours, _ = pair
    torch.manual_seed(sum(sum(g) for g in grids))
    rows = sum(t * h * w for t, h, w in grids)
    pixel_values = torch.randn(rows, PATCH_DIM)
    with torch.no_grad():
        expected = reference_rows(model, pixel_values, grids)
        got = ours(pixel_values, torch.tensor(grids))
    assert got.shape == (rows // 4, 48)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


def test_one_item_equals_transformers_single_call(pair):
    model, ours, _ = pair
    pixel_values = torch.randn(2 * 4 * 6, PATCH_DIM)
    grid = torch.tensor([[2, 4, 6]])
    with torch.no_grad():
        expected = torch.cat(model.model.get_image_features(pixel_values, grid).pooler_output)
        torch.testing.assert_close(ours(pixel_values, grid), expected, rtol=1e-4, atol=1e-5)


def test_items_do_not_attend_to_each_other(pair):
    """An image's rows are the same alone or batched with another image."""
    _, ours, _ = pair
    ours = copy.deepcopy(ours).double()  # float64: batching changes summation order, not the answer
    a, b = torch.randn(16, PATCH_DIM, dtype=torch.float64), torch.randn(8, PATCH_DIM, dtype=torch.float64)
    with torch.no_grad():
        alone = ours(a, [[1, 4, 4]])
        batched = ours(torch.cat([a, b]), [[1, 4, 4], [1, 2, 4]])
    torch.testing.assert_close(batched[:4], alone, rtol=1e-10, atol=1e-12)


def test_segment_max_frames_splits_attention(tmp_path):
    config = tiny_vl_config(vision_segment_max_frames=1)
    _, tensors = saved_checkpoint(tmp_path, config)
    ours = MiniMaxM3VisionEncoder(config)
    ours.load_weights(tensors.items())
    ours.double()  # float64: the two calls' matmuls differ in summation order only
    frames = torch.randn(2 * 8, PATCH_DIM, dtype=torch.float64)
    with torch.no_grad():
        video = ours(frames, [[2, 2, 4]])
        first = ours(frames[:8], [[1, 2, 4]])
    assert ours.attention_windows([(2, 2, 4)]) == [8, 8]
    # the first segment does not see the second: its rows equal the first frame alone
    torch.testing.assert_close(video[:2], first, rtol=1e-10, atol=1e-12)


def test_original_checkpoint_spelling_loads(pair):
    """The shipped checkpoint names the ViT MLP `mlp.fc1`; save_pretrained writes `block_sparse_moe`."""
    model, ours, tensors = pair
    renamed = {k.replace(".block_sparse_moe.", ".mlp."): v for k, v in tensors.items()}
    assert any(".mlp.fc1." in k for k in renamed)
    fresh = MiniMaxM3VisionEncoder(tiny_vl_config())
    fresh.load_weights(renamed.items())
    x = torch.randn(16, PATCH_DIM)
    with torch.no_grad():
        torch.testing.assert_close(fresh(x, [[1, 4, 4]]), ours(x, [[1, 4, 4]]))


def test_load_errors_name_the_tensor(pair):
    _, _, tensors = pair
    missing = {k: v for k, v in tensors.items() if k != "patch_merge_mlp.linear_2.bias"}
    with pytest.raises(ValueError, match=r"missing vision tensor patch_merge_mlp\.linear_2\.bias"):
        MiniMaxM3VisionEncoder(tiny_vl_config()).load_weights(missing.items())

    bad = dict(tensors)
    name = "vision_tower.vision_model.encoder.layers.1.self_attn.q_proj.weight"
    bad[name] = torch.zeros(64, 63)
    with pytest.raises(ValueError, match=rf"{name}: shape \(64, 63\), expected \(64, 64\)"):
        MiniMaxM3VisionEncoder(tiny_vl_config()).load_weights(bad.items())

    extra = dict(tensors)
    extra["vision_tower.vision_model.encoder.layers.7.layer_norm1.weight"] = torch.zeros(64)
    with pytest.raises(ValueError, match=r"unexpected vision tensor .*layers\.7\.layer_norm1"):
        MiniMaxM3VisionEncoder(tiny_vl_config()).load_weights(extra.items())


def test_text_tensors_are_left_alone(pair):
    _, _, tensors = pair
    consumed = MiniMaxM3VisionEncoder(tiny_vl_config()).load_weights(tensors.items())
    assert consumed and not any(k.startswith("language_model") or "lm_head" in k for k in consumed)
    assert {k for k in tensors if not k.startswith(("language_model", "lm_head"))} == consumed


def test_encode_items_takes_sglang_items(pair):
    from types import SimpleNamespace

    _, ours, _ = pair
    a, b = torch.randn(16, PATCH_DIM), torch.randn(2 * 8, PATCH_DIM)
    items = [
        SimpleNamespace(feature=a.to(torch.bfloat16), image_grid_thw=torch.tensor([[1, 4, 4]])),
        SimpleNamespace(feature=b.to(torch.bfloat16), image_grid_thw=torch.tensor([[2, 2, 4]])),
    ]
    with torch.no_grad():
        expected = ours(torch.cat([a, b]).to(torch.bfloat16).float(), [[1, 4, 4], [2, 2, 4]])
        torch.testing.assert_close(ours.encode_items(items, "image_grid_thw"), expected)


def test_bad_input_shapes_are_refused(pair):
    _, ours, _ = pair
    with pytest.raises(ValueError, match=r"pixel_values has shape \(15, 1176\)"):
        ours(torch.randn(15, PATCH_DIM), [[1, 4, 4]])
    with pytest.raises(ValueError, match="not a multiple of spatial_merge_size"):
        ours(torch.randn(12, PATCH_DIM), [[1, 3, 4]])
