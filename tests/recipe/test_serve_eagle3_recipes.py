"""The library recipes with speculation start a real server and decode exactly (issue 15 item 4).

Every library recipe with ``spec.speculative`` is rendered by the real renderer, and its argv
becomes a CPU server's, as ``test_serve_cpu_recipe`` serves cpu-tiny, with the changes listed in
``CPU_CHANGES`` (each with its reason); the flags in ``KEPT`` go to the server as rendered, among
them every speculative flag but the draft's path: algorithm, steps, top-k, draft tokens. A rendered
flag in neither table fails the test, so a new one is decided here rather than passed blindly.
The harness's own flags (``server_harness.cpu_server_args``: float32, 8,192 KV tokens, 0.3 of the
host's RAM, context 4,096) come first; a kept rendered flag it also sets comes later and wins
(``--max-running-requests``), which ``/server_info`` confirms.

The recipes render identical speculative flags (asserted), so one speculative server stands for
all of them, started without ``TRITON_INTERPRET`` as on a user's CPU. The reference is a
target-only server from the same argv without the ``--speculative-*`` flags; both start at once.
"""

from __future__ import annotations

import argparse

import pytest
import requests
from server_harness import _stop, _wait_ready, start_cpu_server
from transformers_oracle import random_prompt

from sglang_m3.commands import tiny_draft as tiny_draft_command
from sglang_m3.recipe import load_recipe, render_launch
from tests.recipe.recipe_factory import flag_pairs, library_files
from tests.speculative.no_interpreter import launch_without_interpreter
from tests.speculative.spec_requests import generate

pytestmark = pytest.mark.server

TINY_TARGET, TINY_DRAFT = object(), object()  # stand-ins filled in per test
DROP = None
#: rendered flag -> (what the CPU server gets instead, why). DROP leaves it out.
CPU_CHANGES: dict[str, tuple[object, str]] = {
    "--model-path": (TINY_TARGET, "the tiny random M3 stands in for the published checkpoint"),
    "--speculative-draft-model-path": (
        TINY_DRAFT, "a `sglang-m3 tiny-draft` EAGLE3 draft of the tiny target stands in for the published draft"),
    "--quantization": (DROP, "MXFP8 layers refuse float32 activations, and the exact comparison serves "
                             "float32; the tiny target is the plain BF16 checkpoint"),
    "--device": (DROP, "the CPU platform (SGLANG_PLATFORM, set by the harness) selects device cpu"),
    "--attention-backend": (DROP, "GPU attention kernels; the CPU platform picks torch_native"),
    "--enable-multimodal": (DROP, "the tiny target is text-only; the draft reads the text model"),
    "--mm-attention-backend": (DROP, "a GPU vision-attention kernel, and no vision tower here"),
    "--tp-size": ("1", "one CPU process: TP 4 or 8 would start that many ranks on a 2-core CI machine"),
    "--context-length": (DROP, "beyond the tiny model's positions; the harness passes 4096"),
    "--page-size": ("16", "a KV page must divide the MSA index block, 128 tokens on M3 and 16 on the "
                          "tiny model (its server refuses 128)"),
    "--mem-fraction-static": (DROP, "a share of GPU memory; on the CPU platform a share of the host's RAM, "
                                    "which CI servers share (the harness passes 0.3 and 8,192 KV tokens)"),
    "--host": (DROP, "the harness serves on loopback"),
    "--port": (DROP, "the harness picks a free port"),
}
KEPT = frozenset({
    "--trust-remote-code", "--speculative-algorithm", "--speculative-num-steps", "--speculative-eagle-topk",
    "--speculative-num-draft-tokens", "--reasoning-parser", "--tool-call-parser", "--default-chat-template-kwargs",
    "--chunked-prefill-size", "--max-running-requests",
})
#: Kept flags and the ``/server_info`` field that must hold the rendered value.
SERVED_FIELDS = {
    "--speculative-algorithm": "speculative_algorithm", "--speculative-num-steps": "speculative_num_steps",
    "--speculative-eagle-topk": "speculative_eagle_topk", "--speculative-num-draft-tokens": "speculative_num_draft_tokens",
    "--chunked-prefill-size": "chunked_prefill_size", "--max-running-requests": "max_running_requests",
    "--reasoning-parser": "reasoning_parser", "--tool-call-parser": "tool_call_parser",
}
NEW_TOKENS = 16
#: 150 tokens: past the tiny model's 64 dense tokens (sparse attention), 10 MSA blocks of 16.
PROMPT = random_prompt(77, 150)


def speculative_recipes() -> list:
    recipes = [load_recipe(path) for path in library_files()]
    return [recipe for recipe in recipes if recipe.spec.speculative is not None]


def cpu_argv(pairs, target: str, draft: str) -> tuple[list[str], str]:
    """``(server flags, model path)`` for the CPU harness from rendered pairs (see ``CPU_CHANGES``)."""
    stand_ins = {TINY_TARGET: target, TINY_DRAFT: draft}
    argv, model = [], None
    for flag, value in pairs:
        if flag in CPU_CHANGES:
            value = stand_ins.get(CPU_CHANGES[flag][0], CPU_CHANGES[flag][0])
            if flag == "--model-path":
                model = value
                continue
            if value is DROP:
                continue
        else:
            assert flag in KEPT, f"rendered flag {flag} is neither kept nor changed for the CPU server: decide it here"
        argv.extend([flag] if value is None else [flag, value])
    return argv, model


def speculative_flags(pairs) -> dict[str, str | None]:
    return {flag: value for flag, value in pairs if flag.startswith("--speculative-")}


def test_speculative_recipes_render_the_same_speculative_flags():
    recipes = speculative_recipes()
    names = {recipe.metadata.name for recipe in recipes}
    assert {"b200-mxfp8-tp4-eagle3", "b300-mxfp8-tp8-eagle3"} <= names, names
    rendered = [speculative_flags(flag_pairs(render_launch(recipe).argv)) for recipe in recipes]
    assert all(flags == rendered[0] for flags in rendered), rendered
    assert rendered[0] == {
        "--speculative-algorithm": "EAGLE3", "--speculative-draft-model-path": "Inferact/MiniMax-M3-EAGLE3",
        "--speculative-num-steps": "3", "--speculative-eagle-topk": "1", "--speculative-num-draft-tokens": "4",
    }


@pytest.fixture(scope="module")
def tiny_draft(tiny_m3_checkpoint, tmp_path_factory) -> str:
    """Written by the ``sglang-m3 tiny-draft`` command (its parser and handler, in-process)."""
    directory = str(tmp_path_factory.mktemp("recipe-draft") / "draft")
    parser = argparse.ArgumentParser(prog="sglang-m3")
    tiny_draft_command.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["tiny-draft", tiny_m3_checkpoint, directory])
    assert args.handler(args) == 0
    return directory


def test_speculative_recipe_serves_the_target_only_tokens(tiny_m3_checkpoint, tiny_draft, server_log_dir):
    recipe = speculative_recipes()[0]  # all render the same speculative flags (test above)
    pairs = flag_pairs(render_launch(recipe).argv)
    argv, model = cpu_argv(pairs, tiny_m3_checkpoint, tiny_draft)
    target_argv, _ = cpu_argv([p for p in pairs if not p[0].startswith("--speculative-")], tiny_m3_checkpoint, tiny_draft)
    assert model == tiny_m3_checkpoint and "--speculative-draft-model-path" in argv

    target = start_cpu_server(model, server_log_dir, *target_argv)  # starts while the other one does
    try:
        with launch_without_interpreter(model, server_log_dir, *argv) as speculative:
            _wait_ready(target)
            info = requests.get(f"{speculative.base_url}/server_info", timeout=300).json()
            for flag, field in SERVED_FIELDS.items():
                rendered = dict(pairs)[flag]
                assert str(info[field]) == rendered, (flag, info[field], rendered)
            assert info["page_size"] == 16 and info["speculative_draft_model_path"] == tiny_draft
            spec = generate(speculative.base_url, PROMPT, NEW_TOKENS)
            plain = generate(target.base_url, PROMPT, NEW_TOKENS)
    finally:
        _stop(target.process)
    assert spec["meta_info"]["spec_verify_ct"] >= 1  # speculation really ran
    assert spec["output_ids"] == plain["output_ids"]
    print(f"{recipe.metadata.name} on CPU: {NEW_TOKENS} tokens in {spec['meta_info']['spec_verify_ct']} verify steps")
