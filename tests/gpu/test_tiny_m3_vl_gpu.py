"""The tiny VL checkpoint (vision tower sized unlike the text model) served by real SGLang on a
CUDA GPU, images in the prompt, against transformers' M3 VL model (fp32, CPU).

The same cases and oracle as the CPU vision-server test (``tests/multimodal/vl_oracle.py``): the
served greedy tokens must be identical to transformers'. Images only: the GPU harness's PyAV is a
stand-in, so no video can be encoded or decoded there. fp32 with IEEE Triton dots and decode
CUDA graphs, as the text-only GPU test serves; the tower runs on the GPU in the scheduler, the
media preprocessing in SGLang's tokenizer process.

Skipped without CUDA. Run on the lent GPU with ``scripts/gpu/run.sh tests``.
"""

from __future__ import annotations

import os
import re
import sys

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.server]

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

sys.path.insert(0, os.path.dirname(__file__))
from gpu_server import launch_gpu_server, log_text  # noqa: E402

from tests.multimodal.vl_oracle import IMAGE_CASES, generate, oracle_tokens, processed, served_tokens  # noqa: E402


@pytest.fixture(scope="module")
def vl_gpu_server(tiny_m3_vl_checkpoint, server_log_dir):
    with launch_gpu_server(tiny_m3_vl_checkpoint, server_log_dir, name="fp32-vl", prefill_graphs=False) as server:
        yield server


def test_decode_cuda_graphs_captured(vl_gpu_server):
    assert re.search(r"Capture .*decode.* end", log_text(vl_gpu_server)), "no decode CUDA graph capture in the server log"


@pytest.mark.parametrize("name", sorted(IMAGE_CASES))
def test_greedy_tokens_match_transformers(vl_gpu_server, tiny_m3_vl_checkpoint, name):
    prompt, images, video = IMAGE_CASES[name]
    inputs = processed(tiny_m3_vl_checkpoint, prompt, images, video)
    result = generate(vl_gpu_server, prompt, images, video)
    served, want = served_tokens(result), oracle_tokens(tiny_m3_vl_checkpoint, inputs)
    print(f"[gpu vl] {name}: {result['meta_info']['prompt_tokens']} prompt tokens, served {served}, transformers {want}")
    assert result["meta_info"]["prompt_tokens"] == inputs["input_ids"].shape[1]
    assert served == want
