"""The H100 MXFP8 recipes' rendered arguments start a real server on the GPU and serve chat
(issue 17 item 5).

Each library recipe for H100 with the MXFP8 checkpoint is rendered by the real renderer and its
argv and environment become the server's, with the changes in ``GPU_CHANGES`` and the additions in
``ADDED`` (each with its reason); every other rendered flag goes to the server as rendered, and a rendered flag the
tables do not know fails the test, so a new one is decided here rather than passed blindly. The
mid-size real-width M3 stands in for the published checkpoint: the shipped VL wrapper with the real
vision tower's settings, 1 dense + 3 MoE/MSA layers at real widths, the published MXFP8
``quantization_config`` (its ignore list from the project's model built on the meta device), the
tiny tokenizer with M3's chat template, and random weights (``--load-format dummy``). The served
checks: ``/server_info`` holds the rendered values, the routed experts and dense linears stay
MXFP8 (the start-up log says so; dummy loading never reaches the loader's per-weight count), a
rendered sparse-offload environment starts the offload path (its log line), and an
``openai`` chat completion with the recipe's parsers returns generated tokens.

Skipped without CUDA. Run on the lent GPU with ``scripts/gpu/run.sh tests -k recipes_gpu``.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

from sglang_m3.recipe import load_recipe, render_launch
from tests.recipe.recipe_factory import LIBRARY, flag_pairs

pytestmark = [pytest.mark.gpu, pytest.mark.server]

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "benchmarks"))
from gpu_server import launch_server_argv  # noqa: E402
from midsize_m3 import add_mxfp8_quantization_config, write_midsize_vl_checkpoint  # noqa: E402
from server_harness import free_port  # noqa: E402

#: every library recipe for H100 with the MXFP8 checkpoint
RECIPES = sorted(
    path.stem for path in LIBRARY.glob("*.yaml")
    if (recipe := load_recipe(path)).spec.hardware.profile == "h100" and recipe.spec.model.variant == "mxfp8"
)
MIDSIZE, PORT = object(), object()  # filled in per test
#: rendered flag -> (what the GPU server gets instead, why)
GPU_CHANGES: dict[str, tuple[object, str]] = {
    "--model-path": (MIDSIZE, "the mid-size real-width M3 (VL layout, MXFP8 config, dummy weights) stands in for "
                              "the published 440 GB checkpoint"),
    "--tp-size": ("1", "one lent GPU; the TP8 memory fit of the full model is the recipe fit's check "
                       "(`sglang-m3 recipe validate`, with the inspect numbers)"),
    "--attention-backend": ("triton", "the harness's sgl_kernel stand-in has no FlashAttention-3 build; "
                                      "a stock install runs the rendered fa3"),
    "--host": ("127.0.0.1", "the test serves on loopback"),
    "--port": (PORT, "the test picks a free port"),
}
#: flags the GPU server gets beyond the rendered ones, with why
ADDED: tuple[tuple[tuple[str, ...], str], ...] = (
    (("--load-format", "dummy"), "the stand-in checkpoint has no tensors"),
    (("--disable-flashinfer-autotune",), "SGLang autotunes flashinfer's MoE runner for any MXFP8 checkpoint; the "
                                         "harness has no flashinfer (a stock install does)"),
)
KEPT = frozenset({
    "--trust-remote-code", "--quantization", "--device", "--context-length", "--page-size", "--kv-cache-dtype",
    "--reasoning-parser", "--tool-call-parser", "--default-chat-template-kwargs", "--enable-multimodal",
    "--mem-fraction-static", "--chunked-prefill-size", "--max-running-requests",
})
#: kept flags and the ``/server_info`` field that must hold the rendered value
SERVED_FIELDS = {
    "--quantization": "quantization", "--context-length": "context_length", "--page-size": "page_size",
    "--kv-cache-dtype": "kv_cache_dtype", "--reasoning-parser": "reasoning_parser",
    "--tool-call-parser": "tool_call_parser", "--mem-fraction-static": "mem_fraction_static",
    "--chunked-prefill-size": "chunked_prefill_size", "--max-running-requests": "max_running_requests",
}
#: start-up log lines of a model that keeps its routed experts and dense linears in MXFP8
MXFP8_LOG_LINES = ("M3 MoE experts: mxfp8 path", "dense linears kept in MXFP8")
#: rendered environment variable -> the start-up log line that shows the server acted on it
ENV_LOG_LINES = {"SGLANG_M3_SPARSE_OFFLOAD_BLOCKS": "M3 sparse offload: MSA Triton path"}


def gpu_argv(pairs, model: str, port: int) -> list[str]:
    """The server's argv from rendered ``pairs`` (see ``GPU_CHANGES``, ``KEPT`` and ``ADDED``)."""
    stand_ins = {MIDSIZE: model, PORT: str(port)}
    argv: list[str] = []
    for flag, value in pairs:
        if flag in GPU_CHANGES:
            value = stand_ins.get(GPU_CHANGES[flag][0], GPU_CHANGES[flag][0])
        else:
            assert flag in KEPT, f"rendered flag {flag} is neither kept nor changed for the GPU server: decide it here"
        argv.extend([flag] if value is None else [flag, value])
    for flags, _why in ADDED:
        argv.extend(flags)
    return argv


@pytest.fixture(scope="module")
def midsize_mxfp8(tmp_path_factory) -> str:
    return add_mxfp8_quantization_config(write_midsize_vl_checkpoint(str(tmp_path_factory.mktemp("midsize-vl-mxfp8"))))


@pytest.mark.parametrize("name", RECIPES)
def test_rendered_h100_recipe_serves_the_midsize_mxfp8_model(name, midsize_mxfp8, server_log_dir):
    import openai
    import requests

    launch = render_launch(load_recipe(LIBRARY / f"{name}.yaml"))
    pairs = flag_pairs(launch.argv)
    expected_log = MXFP8_LOG_LINES + tuple(line for key, line in ENV_LOG_LINES.items() if key in launch.env)
    port = free_port()
    argv = gpu_argv(pairs, midsize_mxfp8, port)
    with launch_server_argv(argv, port, midsize_mxfp8, server_log_dir, env=launch.env, name=f"recipe-{name}") as server:
        info = requests.get(f"{server.base_url}/server_info", timeout=30).json()
        rendered = dict(pairs)
        for flag, field in SERVED_FIELDS.items():
            if flag in rendered:
                assert str(info[field]) == rendered[flag], (flag, info[field], rendered[flag])
        with open(server.log_path, encoding="utf-8", errors="replace") as handle:
            log = handle.read()
        assert all(line in log for line in expected_log), [line for line in expected_log if line not in log]
        client = openai.OpenAI(base_url=server.openai_url, api_key="none")
        reply = client.chat.completions.create(
            model=midsize_mxfp8, messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=24, temperature=0,
        )
        print(f"[gpu recipe {name}] finish {reply.choices[0].finish_reason}, tokens {reply.usage.completion_tokens}")
        assert reply.usage.completion_tokens > 0
        assert reply.choices[0].finish_reason in ("length", "stop")
