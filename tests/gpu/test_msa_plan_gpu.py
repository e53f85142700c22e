"""The prefill plan's tiles and token positions built on the GPU equal the ones built on the CPU.

``msa_kernels.plan`` builds them on the batch's device from the host-side lengths (no host sync);
``tests/kernels/test_msa_plan.py`` checks the CPU build against the definition, this the CUDA
build against the CPU one on random batches.
"""

from __future__ import annotations

import random

import pytest
import torch

from msa_kernels.plan import _tiles_for, _token_positions

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def random_batches(count: int, seed: int = 0):
    rng = random.Random(seed)
    for _ in range(count):
        extend_lens = [rng.randint(1, 9000) for _ in range(rng.randint(1, 6))]
        yield [ext + rng.randint(0, 40000) for ext in extend_lens], extend_lens


@pytest.mark.parametrize("tile_tokens", [1, 2, 32])
def test_tiles_on_cuda_equal_cpu(tile_tokens):
    for seq_lens, extend_lens in random_batches(200):
        on_cpu, on_cuda = _tiles_for(seq_lens, extend_lens, tile_tokens, CPU), _tiles_for(seq_lens, extend_lens, tile_tokens, CUDA)
        for field in ("req", "tok0", "pos0", "ntok"):
            assert torch.equal(getattr(on_cpu, field), getattr(on_cuda, field).cpu()), (seq_lens, extend_lens, field)


def test_token_positions_on_cuda_equal_cpu():
    for seq_lens, extend_lens in random_batches(200, seed=1):
        for want, got in zip(_token_positions(seq_lens, extend_lens, CPU), _token_positions(seq_lens, extend_lens, CUDA)):
            assert torch.equal(want, got.cpu()), (seq_lens, extend_lens)
