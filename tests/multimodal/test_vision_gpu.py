"""The vision tower on CUDA in bf16 (M3's real widths, fewer layers) against float32 on the CPU."""

import pytest
import torch

from sglang_m3.models.vision import MiniMaxM3VisionEncoder

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

# M3's vision widths (M3_FACTS s.1): hidden 1280, 16 heads (head_dim 80), patch 14, temporal 2,
# merge 2, projector to the text width; 4 of the 32 layers and a narrower text width keep it quick.
CONFIG = {
    "vision_config": {
        "hidden_size": 1280,
        "intermediate_size": 5120,
        "num_hidden_layers": 4,
        "num_attention_heads": 16,
        "rope_parameters": {"rope_type": "axial", "rope_theta": 10000.0},
    },
    "text_config": {"hidden_size": 2048},
    "projector_hidden_size": 2048,
}


@pytest.fixture(scope="module")
def encoders():
    torch.manual_seed(0)
    reference = MiniMaxM3VisionEncoder(CONFIG).eval()
    with torch.no_grad():
        for name, param in reference.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.1 * torch.randn_like(param) if name.endswith("weight") else 0.1 * torch.randn_like(param))
            else:
                fan_in = param.shape[-1] if param.dim() > 1 else 1
                param.copy_(torch.randn_like(param) / (fan_in**0.5 if param.dim() > 1 else 10.0))
        reference.patch_embedding.copy_(torch.randn_like(reference.patch_embedding) / (3 * 2 * 14 * 14) ** 0.5)
    gpu = MiniMaxM3VisionEncoder(CONFIG).eval()
    gpu.load_state_dict(reference.state_dict())
    return reference, gpu.to("cuda", torch.bfloat16)


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got.float().cpu() - expected).norm() / expected.norm()).item()


def test_bf16_cuda_matches_float32_cpu(encoders):
    reference, gpu = encoders
    grids = [[1, 32, 46], [1, 8, 8], [4, 16, 20]]
    rows = sum(t * h * w for t, h, w in grids)
    pixel_values = torch.randn(rows, 3 * 2 * 14 * 14)
    with torch.no_grad():
        expected = reference(pixel_values, grids)
        got = gpu(pixel_values.to("cuda", torch.bfloat16), grids)
    assert got.shape == expected.shape == (rows // 4, 2048)
    assert relative_error(got, expected) < 3e-2


def test_items_stay_independent_on_cuda(encoders):
    _, gpu = encoders
    a = torch.randn(32 * 46, 3 * 2 * 14 * 14, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8 * 8, 3 * 2 * 14 * 14, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        alone = gpu(a, [[1, 32, 46]])
        batched = gpu(torch.cat([a, b]), [[1, 32, 46], [1, 8, 8]])
    torch.testing.assert_close(batched[: alone.shape[0]], alone, rtol=2e-2, atol=2e-2)
