"""The real SGLang CPU server serves the MXFP8 tiny checkpoint exactly like its dequantized twin.

The twin (``tiny-checkpoint --mxfp8-dequantized``) stores the MXFP8 checkpoint's weights after
quantize -> dequantize as plain fp32 tensors; the MXFP8 server dequantizes the same pairs at load.
Dequantization is exact in fp32 (an e4m3 value times a power of two), so both servers hold
bit-identical parameters and run the same CPU kernels on the same sequential requests: greedy
tokens must be identical and prompt/output logprobs equal. The tolerance is 0 for that reason;
any difference means the loader put a different weight somewhere. Two servers in sequence, plus
one start that must be refused at load (a config-stage refusal, e.g. quant_method 'gptq', goes
through the same start-up check as tests/config/test_broken_config_server.py; the reader's
refusals are unit-tested in tests/quant/test_quantization_config.py).
"""

from __future__ import annotations

import os
import shutil

import pytest
import requests
from server_harness import expect_start_refused, launch_cpu_server

from sglang_m3.tiny.checkpoint import build_tiny_checkpoint

pytestmark = pytest.mark.server

PROMPTS = [
    "The quick brown fox jumps over the lazy dog " * 3,
    "M3 serves MXFP8 weights dequantized at load on the CPU platform.",
    "a b c d e f g h i j k l m n o p q r s t u v w x y z " * 4,  # several prefill chunks
]
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    base = tmp_path_factory.mktemp("mxfp8")
    return {
        mode: build_tiny_checkpoint(str(base / mode), quantization=mode) for mode in ("mxfp8", "mxfp8-dequantized")
    }


def _generate(base_url: str, prompt: str) -> dict:
    reply = requests.post(
        f"{base_url}/generate",
        json={
            "text": prompt,
            "sampling_params": {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True},
            "return_logprob": True,
            "logprob_start_len": 0,
        },
        timeout=300,
    )
    reply.raise_for_status()
    meta = reply.json()["meta_info"]
    return {
        "tokens": [t[1] for t in meta["output_token_logprobs"]],
        "output": [t[0] for t in meta["output_token_logprobs"]],
        "prompt": [t[0] for t in meta["input_token_logprobs"] if t[0] is not None],
    }


@pytest.fixture(scope="module")
def served(checkpoints, server_log_dir):
    results = {}
    for mode, path in checkpoints.items():
        with launch_cpu_server(path, server_log_dir) as server:
            results[mode] = [_generate(server.base_url, prompt) for prompt in PROMPTS]
            if mode == "mxfp8":
                with open(server.log_path, encoding="utf-8") as handle:
                    results["log"] = handle.read()
    return results


def test_mxfp8_checkpoint_is_dequantized_at_load(checkpoints, served):
    from safetensors import safe_open

    with safe_open(os.path.join(checkpoints["mxfp8"], "model.safetensors"), "pt") as handle:
        pairs = sum(name.endswith(".weight_scale_inv") for name in handle.keys())
    assert pairs == 4 * 4 + 3 + 3 * (8 * 3 + 3)  # attention q/k/v/o, dense MLP, routed + shared experts
    assert "MXFP8 checkpoint: building unquantized layers" in served["log"]
    assert f"dequantized {pairs} MXFP8 weight(s) at load" in served["log"]


def test_greedy_tokens_and_logprobs_equal_the_dequantized_twin(served):
    worst = 0.0
    for mx, twin in zip(served["mxfp8"], served["mxfp8-dequantized"]):
        assert mx["tokens"] == twin["tokens"]
        assert len(mx["prompt"]) == len(twin["prompt"]) > 0
        for a, b in zip(mx["prompt"] + mx["output"], twin["prompt"] + twin["output"]):
            worst = max(worst, abs(a - b))
    print(f"max |logprob difference| MXFP8 vs dequantized twin: {worst}")
    assert worst == 0.0


def _copy_with(source: str, target: str, edit_tensors) -> str:
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, target)
    path = os.path.join(target, "model.safetensors")
    tensors = load_file(path)
    edit_tensors(tensors)
    save_file(tensors, path, metadata={"format": "pt"})
    return target


def test_missing_scale_is_refused_at_load_naming_the_tensor(checkpoints, server_log_dir, tmp_path):
    name = "language_model.model.layers.2.block_sparse_moe.experts.5.w2.weight"

    def drop_scale(tensors):
        del tensors[name + "_scale_inv"]

    broken = _copy_with(checkpoints["mxfp8"], str(tmp_path / "noscale"), drop_scale)
    refused = expect_start_refused(broken, server_log_dir)
    assert refused.returncode != 0
    assert f"checkpoint tensor '{name}' is float8_e4m3fn but its scale" in refused.log, refused.log[-3000:]
