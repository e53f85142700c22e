"""The GPU harness's ``transfer_kv_direct`` stand-in (HiCache's direct io backend), on CPU tensors.

The op is a row copy per layer pair; what matters is that rows land at the destination indices
from the source indices, layer by layer, with nothing else touched, for unordered and page-sized
runs alike, and that mismatched inputs are refused rather than half-copied.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

OPS = Path(__file__).resolve().parents[1] / "scripts" / "gpu" / "standins" / "sgl_kernel" / "ops.py"


@pytest.fixture(scope="module")
def ops():
    spec = importlib.util.spec_from_file_location("harness_standin_ops", OPS)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("page_size", [1, 4])
def test_rows_move_between_layer_pairs_at_their_indices(ops, page_size):
    generator = torch.Generator().manual_seed(page_size)
    src = [torch.randn(32, 2, 8, generator=generator) for _ in range(3)]
    dst = [torch.zeros(40, 2, 8) for _ in range(3)]
    src_idx = torch.tensor([8, 9, 10, 11, 3, 0, 1, 2])  # a page-aligned run, then unordered rows
    dst_idx = torch.tensor([36, 37, 38, 39, 5, 20, 21, 22])
    ops.transfer_kv_direct(src, dst, src_idx, dst_idx, page_size)
    for layer in range(3):
        expected = torch.zeros(40, 2, 8)
        expected[dst_idx] = src[layer][src_idx]
        assert torch.equal(dst[layer], expected)


def test_mismatched_inputs_are_refused_before_any_copy(ops):
    src, dst = [torch.ones(4, 2)], [torch.zeros(4, 2), torch.zeros(4, 2)]
    with pytest.raises(ValueError, match="1 source layers for 2 destinations"):
        ops.transfer_kv_direct(src, dst, torch.tensor([0]), torch.tensor([1]), 1)
    with pytest.raises(ValueError, match="2 source rows for 1 destinations"):
        ops.transfer_kv_direct(src, dst[:1], torch.tensor([0, 1]), torch.tensor([1]), 1)
    assert not dst[0].any() and not dst[1].any()
