"""Acceptance: SGLang 0.5.23's own argument handling accepts every rendered command line.

``python -m sglang.launch_server`` runs ``prepare_server_args(argv)`` (SGLang's parser built by
``ServerArgs.add_cli_args``, then ``ServerArgs.from_cli_args``) and only afterwards
``resolve_once``, which reads the checkpoint and probes the hardware. These tests call the
same ``prepare_server_args`` on each rendered argv and stop there. What that proves: every
flag exists in SGLang 0.5.23, every value has the type and is among the choices SGLang
allows, nothing is repeated or abbreviated, and each field of the resulting ServerArgs holds
the value the recipe asked for. It does not prove that resolution or the server start
succeeds on the named hardware (that needs the GPUs and the weights).
"""

from __future__ import annotations

import argparse
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sglang_m3.recipe import get_profile, load_recipe, parse_recipe, render_launch
from sglang_m3.recipe.render import TYPED_FLAGS, attention_backend_for
from sglang_m3.recipe.schema import NO_PARSER
from tests.recipe.recipe_factory import library_files, recipe_document

server_args_module = pytest.importorskip("sglang.srt.server_args")

LEADER = "10.0.0.1:20000"


def parse_with_sglang(argv: list[str]):
    return server_args_module.prepare_server_args(list(argv))


def expected_fields(recipe) -> dict:
    """What ServerArgs should hold, stated from the recipe (not from the renderer)."""
    spec = recipe.spec
    profile = get_profile(spec.hardware.profile)
    parallel = spec.parallelism
    expected = {
        "model_path": spec.model.path,
        "revision": spec.model.revision,
        "trust_remote_code": spec.model.trust_remote_code,
        "device": profile.device,
        "attention_backend": attention_backend_for(profile, spec.kv_cache.dtype),
        "tp_size": parallel.tp,
        "pp_size": parallel.pp,
        "dp_size": parallel.dp,
        "ep_size": parallel.ep,
        "context_length": spec.context_length,
        "page_size": spec.kv_cache.page_size,
        "kv_cache_dtype": spec.kv_cache.dtype,
        "quantization": "mxfp8" if spec.model.variant == "mxfp8" else None,
        "reasoning_parser": None if spec.parsers.reasoning == NO_PARSER else spec.parsers.reasoning,
        "tool_call_parser": None if spec.parsers.tool_call == NO_PARSER else spec.parsers.tool_call,
        "default_chat_template_kwargs": {"thinking_mode": spec.parsers.default_thinking_mode},
        "enable_multimodal": spec.multimodal.enabled or None,
        "language_model_only": not spec.multimodal.enabled,
        "mem_fraction_static": spec.serving.mem_fraction_static,
        "max_running_requests": spec.serving.max_running_requests,
        "max_total_tokens": spec.serving.max_total_tokens,
        "host": spec.serving.host,
        "port": spec.serving.port,
        "nnodes": spec.hardware.nodes,
        "chunked_prefill_size": spec.serving.chunked_prefill_size,
    }
    if parallel.attention_dp > 1:
        expected["attn_dp_size"] = parallel.attention_dp
    if spec.serving.watchdog_timeout is not None:
        expected["watchdog_timeout"] = spec.serving.watchdog_timeout
    if spec.hardware.nodes > 1:
        expected.update(node_rank=0, dist_init_addr=LEADER)
    speculative = spec.speculative
    if speculative is not None:
        expected.update(
            speculative_algorithm=speculative.algorithm,
            speculative_num_steps=speculative.num_steps,
            speculative_eagle_topk=speculative.eagle_topk,
            speculative_num_draft_tokens=speculative.num_draft_tokens,
            speculative_draft_model_path=(speculative.draft_model.path
                                          if speculative.draft_model else None),
            speculative_adaptive=speculative.adaptive,
        )
    return expected


def assert_sglang_holds(recipe) -> None:
    launch = render_launch(recipe, node_rank=0, dist_init_addr=LEADER)
    server_args = parse_with_sglang(launch.argv)
    for field, value in expected_fields(recipe).items():
        assert getattr(server_args, field) == value, (field, getattr(server_args, field), value)


@pytest.mark.parametrize("path", library_files(), ids=lambda path: path.stem)
def test_sglang_accepts_every_library_recipe(path):
    assert_sglang_holds(load_recipe(path))


def test_typed_flags_list_every_alias_sglang_registers():
    """An alias missing from TYPED_FLAGS would let extraArgs duplicate a typed field."""
    parser = argparse.ArgumentParser()
    server_args_module.ServerArgs.add_cli_args(parser)
    by_dest: dict[str, set[str]] = {}
    for action in parser._actions:
        by_dest.setdefault(action.dest, set()).update(action.option_strings)
    owned_dests = {dest for dest, flags in by_dest.items() if flags & set(TYPED_FLAGS)}
    for dest in owned_dests:
        missing = by_dest[dest] - set(TYPED_FLAGS)
        assert not missing, (dest, missing)
    # and every typed flag is a real SGLang option
    known = set().union(*by_dest.values())
    assert set(TYPED_FLAGS) <= known, set(TYPED_FLAGS) - known
    # the abbreviation check refuses prefixes of typed flags: no option SGLang accepts for
    # another setting may be such a prefix, or a legitimate extra argument would be refused
    others = known - set().union(*(by_dest[dest] for dest in owned_dests))
    clashes = {o for o in others for typed in TYPED_FLAGS if typed.startswith(o) and len(o) > 3}
    assert not clashes


# --- property: random sound recipes render to command lines SGLang parses faithfully --------

GPU_PROFILES = ["h100", "h200", "b200", "b300", "gb200", "mi300x", "mi325x", "mi350x", "mi355x"]


@st.composite
def recipes(draw):
    profile = draw(st.sampled_from(GPU_PROFILES))
    tp = draw(st.sampled_from([1, 2, 4, 8]))
    ep = draw(st.sampled_from([e for e in (1, 2, 4, 8) if tp % e == 0]))
    attention_dp = draw(st.sampled_from([a for a in (1, 2, 4, 8) if tp % a == 0]))
    speculative = draw(st.one_of(
        st.none(),
        st.builds(lambda steps, adaptive: {"algorithm": "EAGLE3", "numSteps": steps,
                                           "numDraftTokens": steps + 1, "adaptive": adaptive,
                                           "draftModel": {"path": "Inferact/MiniMax-M3-EAGLE3"}},
                  st.integers(1, 6), st.booleans()),
        st.just({"algorithm": "NGRAM", "numSteps": 2, "numDraftTokens": 3}),
    ))
    document = recipe_document(
        spec__hardware={"profile": profile, "gpusPerNode": tp,
                        "nodes": draw(st.integers(1, 3))},
        spec__model={"path": draw(st.sampled_from(["MiniMaxAI/MiniMax-M3", "/models/m3"])),
                     "variant": draw(st.sampled_from(["bf16", "mxfp8"])),
                     "revision": draw(st.one_of(st.none(), st.just("main"))),
                     "trustRemoteCode": draw(st.booleans())},
        spec__parallelism={"tp": tp, "ep": ep, "attentionDp": attention_dp,
                           "dp": 1, "pp": 1},
        spec__contextLength=draw(st.integers(1, 1_048_576)),
        spec__kvCache={"pageSize": 128,
                       "dtype": draw(st.sampled_from(["auto", "bf16", "fp8_e4m3", "fp8_e5m2"]))},
        spec__speculative=speculative,
        spec__parsers={"reasoning": draw(st.sampled_from(["minimax-m3", NO_PARSER])),
                       "toolCall": draw(st.sampled_from(["minimax-m3", NO_PARSER])),
                       "defaultThinkingMode": draw(st.sampled_from(
                           ["adaptive", "enabled", "disabled"]))},
        spec__multimodal={"enabled": draw(st.booleans())},
        spec__serving={
            "memFractionStatic": draw(st.floats(0.5, 0.95)),
            "chunkedPrefillSize": draw(st.sampled_from([-1, 4096, 8192, 16384])),
            "maxRunningRequests": draw(st.integers(1, 512)),
            "maxTotalTokens": draw(st.one_of(st.none(), st.integers(1024, 10**7))),
            "watchdogTimeout": draw(st.one_of(st.none(), st.floats(10, 7200))),
            "port": draw(st.integers(1024, 65535)),
        },
    )
    return parse_recipe(document)  # rendered as is: the rules are not this property's subject


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(recipes())
def test_sglang_parses_rendered_random_recipes(recipe):
    assert_sglang_holds(recipe)


def test_media_limits_and_host_offload_reach_sglang():
    recipe = parse_recipe(recipe_document(
        spec__multimodal={"enabled": True, "limitPerRequest": {"image": 3, "video": 0}},
        spec__hostOffload={"mode": "hierarchical-cache", "sizeGbPerRank": 64}))
    server_args = parse_with_sglang(render_launch(recipe).argv)
    assert server_args.limit_mm_data_per_request == {"image": 3, "video": 0}
    assert server_args.enable_hierarchical_cache and server_args.hicache_size == 64
    hisparse = parse_recipe(recipe_document(
        spec__hostOffload={"mode": "hisparse", "hostToDeviceRatio": 2.0}))
    server_args = parse_with_sglang(render_launch(hisparse).argv)
    assert server_args.enable_hisparse and server_args.disable_radix_cache
    assert json.loads(server_args.hisparse_config) == {"host_to_device_ratio": 2.0}
