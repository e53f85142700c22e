"""Deployment rules: targeted cases and hypothesis properties over the parallelism space."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_m3.recipe import CATALOG, MAX_CONTEXT_LENGTH, validate_recipe
from sglang_m3.recipe.render import TYPED_FLAGS
from sglang_m3.recipe.rules import ADAPTIVE_DROPPED_BY
from sglang_m3.recipe.schema import NO_PARSER
from tests.recipe.recipe_factory import make_recipe

DIVISORS_OF_64 = {1, 2, 4, 8, 16, 32, 64}


def rules_fired(recipe) -> set[str]:
    return {finding.rule for finding in validate_recipe(recipe)}


def test_base_recipe_is_clean():
    assert validate_recipe(make_recipe()) == []


@settings(max_examples=200, deadline=None)
@given(tp=st.integers(1, 16), pp=st.integers(1, 4), dp=st.integers(1, 4),
       per_node=st.integers(1, 8), nodes=st.integers(1, 4))
def test_gpu_count_rule_fires_exactly_when_the_product_differs(tp, pp, dp, per_node, nodes):
    recipe = make_recipe(spec__hardware={"profile": "b200", "gpusPerNode": per_node,
                                         "nodes": nodes},
                         spec__parallelism={"tp": tp, "pp": pp, "dp": dp, "ep": 1})
    fired = "parallelism.gpu-count" in rules_fired(recipe)
    assert fired == (tp * pp * dp != per_node * nodes)


@settings(max_examples=200, deadline=None)
@given(tp=st.integers(1, 128), attention_dp=st.integers(1, 16))
def test_head_rules_fire_exactly_for_unsplittable_attention(tp, attention_dp):
    recipe = make_recipe(spec__parallelism={"tp": tp, "ep": 1, "attentionDp": attention_dp})
    fired = rules_fired(recipe)
    if tp % attention_dp:
        assert "parallelism.attention-dp" in fired
        return
    attention_tp = tp // attention_dp
    splittable = attention_tp in DIVISORS_OF_64  # then 4 KV heads split or replicate evenly
    assert ("parallelism.heads" in fired) == (not splittable)


@settings(max_examples=100, deadline=None)
@given(tp=st.sampled_from([1, 2, 4, 8, 16]), ep=st.integers(1, 32),
       profile=st.sampled_from(["b200", "mi300x", "mi355x"]))
def test_expert_parallel_rules(tp, ep, profile):
    recipe = make_recipe(spec__hardware={"profile": profile, "gpusPerNode": min(tp, 8),
                                         "nodes": max(1, tp // 8)},
                         spec__parallelism={"tp": tp, "ep": ep},
                         spec__serving={"watchdogTimeout": 3600})
    fired = rules_fired(recipe)
    assert ("parallelism.ep-divides-tp" in fired) == (tp % ep != 0)
    assert ("amd.ep-equals-tp" in fired) == (CATALOG[profile].is_amd and ep != tp)


@settings(max_examples=100, deadline=None)
@given(context=st.integers(1, 4 * MAX_CONTEXT_LENGTH))
def test_context_rule_fires_exactly_beyond_one_million(context):
    recipe = make_recipe(spec__contextLength=context, spec__serving={"maxRunningRequests": 1,
                                                                     "chunkedPrefillSize": -1})
    assert ("context.max" in rules_fired(recipe)) == (context > MAX_CONTEXT_LENGTH)


@settings(max_examples=100, deadline=None)
@given(page=st.integers(1, 1024), profile=st.sampled_from(sorted(CATALOG)))
def test_page_size_rule_applies_to_gpus_only(page, profile):
    recipe = make_recipe(spec__hardware={"profile": profile, "gpusPerNode": 1},
                         spec__parallelism={"tp": 1}, spec__kvCache={"pageSize": page})
    assert ("kv.page-size" in rules_fired(recipe)) == (CATALOG[profile].is_gpu and page != 128)


@settings(max_examples=100, deadline=None)
@given(profile=st.sampled_from(sorted(CATALOG)), variant=st.sampled_from(["bf16", "mxfp8"]))
def test_variant_rule_follows_the_catalog(profile, variant):
    recipe = make_recipe(spec__hardware={"profile": profile, "gpusPerNode": 1},
                         spec__parallelism={"tp": 1},
                         spec__model={"path": "m3", "variant": variant})
    assert ("hardware.variant" in rules_fired(recipe)) == (variant not in CATALOG[profile].variants)


def test_mxfp8_runs_on_every_gpu():
    able = {name for name, p in CATALOG.items() if "mxfp8" in p.variants}
    assert able == {"h100", "h200", "b200", "b300", "gb200", "mi300x", "mi325x", "mi350x", "mi355x"}


@settings(max_examples=150, deadline=None)
@given(flag=st.sampled_from(sorted(TYPED_FLAGS)), value=st.text(min_size=1, max_size=8),
       equals=st.booleans(), position=st.integers(0, 3))
def test_any_typed_flag_in_extra_args_is_refused_naming_its_field(flag, value, equals, position):
    harmless = ["--enable-metrics", "--log-level", "info"][:position]
    extra = harmless + ([f"{flag}={value}"] if equals else [flag, value])
    findings = validate_recipe(make_recipe(spec__serving__extraArgs=extra))
    duplicate = [f for f in findings if f.rule == "serving.extra-args-duplicate"]
    assert duplicate, extra
    assert duplicate[0].field == f"spec.serving.extraArgs[{len(harmless)}]"
    assert TYPED_FLAGS[flag] in duplicate[0].message


@pytest.mark.parametrize("abbreviation, owners", [
    ("--speculative-num", ["spec.speculative.numDraftTokens", "spec.speculative.numSteps"]),
    ("--speculative-draft-model-", ["spec.speculative.draftModel.path", "spec.speculative.draftModel.revision"]),
    ("--enable-hi", ["spec.hostOffload", "spec.hostOffload.mode"]),
])
def test_an_abbreviation_of_typed_flags_of_several_fields_is_refused_as_ambiguous(abbreviation, owners):
    """argparse refuses an abbreviation that several options start with; the refusal names every
    field they belong to instead of the first one found."""
    findings = validate_recipe(make_recipe(spec__serving__extraArgs=["--enable-metrics", abbreviation, "1"]))
    refusals = [f for f in findings if f.rule.startswith("serving.extra-args")]
    assert [(f.rule, f.field) for f in refusals] == [("serving.extra-args-ambiguous", "spec.serving.extraArgs[1]")]
    assert " or ".join(owners) in refusals[0].message


def test_an_abbreviation_of_options_of_one_field_duplicates_that_field():
    """``--mod`` starts both ``--model`` and ``--model-path`` (aliases of spec.model.path), and
    ``--tensor-parallel`` only ``--tensor-parallel-size``: each duplicates the one field."""
    for abbreviation, owner in (("--mod", "spec.model.path"), ("--tensor-parallel", "spec.parallelism.tp")):
        findings = validate_recipe(make_recipe(spec__serving__extraArgs=[abbreviation, "2"]))
        assert [f.rule for f in findings if f.rule.startswith("serving.extra-args")] == ["serving.extra-args-duplicate"]
        assert owner in next(f.message for f in findings if f.rule == "serving.extra-args-duplicate")


@pytest.mark.parametrize("arguments", [["--disaggregation-mode", "prefill"], ["--disaggregation-mode=decode"],
                                       ["--disaggregation-mo", "decode"]])
def test_prefill_decode_disaggregation_is_refused_as_the_server_refuses_it(arguments):
    """The server refuses it at pool build (the index keys are not transferred): validate says so first."""
    findings = validate_recipe(make_recipe(spec__serving__extraArgs=arguments))
    refused = [f for f in findings if f.rule == "serving.disaggregation-unsupported"]
    assert [f.field for f in refused] == ["spec.serving.extraArgs[0]"]
    assert "index keys" in refused[0].message


def test_disaggregation_mode_null_passes():
    findings = validate_recipe(make_recipe(spec__serving__extraArgs=["--disaggregation-mode", "null"]))
    assert not [f for f in findings if f.rule == "serving.disaggregation-unsupported"]


@settings(max_examples=100, deadline=None)
@given(name=st.from_regex(r"--[a-z][a-z0-9-]{3,20}", fullmatch=True))
def test_extra_args_that_own_no_typed_field_pass(name):
    owned = any(typed.startswith(name) for typed in TYPED_FLAGS) or name == "--config"
    recipe = make_recipe(spec__serving__extraArgs=[name, "1"])
    refusals = [f for f in validate_recipe(recipe) if f.rule.startswith("serving.extra-args")]
    assert bool(refusals) == owned


def test_a_draft_tree_shorter_than_its_steps_is_refused():
    """SGLang accepts a top-k 2, 3-step tree of 2 verify tokens and fails at its first decode."""
    speculative = {"algorithm": "EAGLE3", "draftModel": {"path": "Inferact/MiniMax-M3-EAGLE3"},
                   "eagleTopk": 2, "numSteps": 3, "numDraftTokens": 2}
    hopper = {"spec__hardware": {"profile": "h200"}, "spec__model": {"path": "MiniMaxAI/MiniMax-M3", "variant": "bf16"}}
    findings = validate_recipe(make_recipe(spec__speculative=speculative, **hopper))
    assert [f.field for f in findings if f.rule == "speculative.tree-too-short"] == ["spec.speculative.numDraftTokens"]
    ok = validate_recipe(make_recipe(spec__speculative={**speculative, "numDraftTokens": 4}, **hopper))
    assert not [f for f in ok if f.rule == "speculative.tree-too-short"]


def test_speculative_rules():
    draft = {"path": "Inferact/MiniMax-M3-EAGLE3"}
    cases = {
        "speculative.draft-required": {"algorithm": "EAGLE3"},
        "speculative.ngram-no-draft": {"algorithm": "NGRAM", "draftModel": draft},
        "speculative.ngram-tree": {"algorithm": "NGRAM", "numSteps": 2, "numDraftTokens": 3},
        "speculative.algorithm-draft": {"algorithm": "EAGLE", "draftModel": draft},
        "speculative.tree-attention-backend": {"algorithm": "EAGLE3", "draftModel": draft, "eagleTopk": 2},
        "speculative.draft-tokens": {"algorithm": "EAGLE3", "draftModel": draft,
                                     "numSteps": 2, "numDraftTokens": 4},
    }
    for rule, speculative in cases.items():
        assert rule in rules_fired(make_recipe(spec__speculative=speculative)), rule
    good = make_recipe(spec__speculative={"algorithm": "EAGLE3", "draftModel": draft})
    assert not {r for r in rules_fired(good) if r.startswith("speculative.")}
    hopper = make_recipe(spec__hardware={"profile": "h200"},
                         spec__model={"path": "MiniMaxAI/MiniMax-M3", "variant": "bf16"},
                         spec__speculative={"algorithm": "EAGLE3", "draftModel": draft})
    assert not {r for r in rules_fired(hopper) if r.startswith("speculative.")}
    amd = make_recipe(spec__hardware={"profile": "mi300x"},
                      spec__model={"path": "MiniMaxAI/MiniMax-M3", "variant": "bf16"},
                      spec__speculative={"algorithm": "EAGLE3", "draftModel": draft})
    assert "speculative.unverified-gpu" in rules_fired(amd)


ADAPTIVE_CHAIN = {"algorithm": "EAGLE3", "draftModel": {"path": "Inferact/MiniMax-M3-EAGLE3"}, "numSteps": 3,
                  "numDraftTokens": 4, "adaptive": True}


@settings(max_examples=100, deadline=None)
@given(algorithm=st.sampled_from(["EAGLE3", "EAGLE", "NGRAM"]), topk=st.integers(1, 4), steps=st.integers(1, 8),
       attention_dp=st.sampled_from([1, 2]), adaptive=st.booleans())
def test_adaptive_rules_fire_exactly_where_sglang_drops_or_refuses_adaptive(algorithm, topk, steps, attention_dp,
                                                                          adaptive):
    """SGLang 0.5.23 adapts EAGLE / EAGLE3 chains (top-k 1) without attention DP, starting from 1, 3, 5 or 7
    steps: it drops the flag with a log warning otherwise, and refuses another start at start-up."""
    draft = None if algorithm == "NGRAM" else {"path": "/drafts/m3-draft"}
    recipe = make_recipe(spec__parallelism={"tp": 8, "ep": 8, "attentionDp": attention_dp},
                         spec__speculative={"algorithm": algorithm, "draftModel": draft, "eagleTopk": topk,
                                            "numSteps": steps, "numDraftTokens": steps + 1, "adaptive": adaptive})
    fired = rules_fired(recipe)
    expected = {rule for rule, applies in (
        ("speculative.adaptive-algorithm", algorithm == "NGRAM"),
        ("speculative.adaptive-tree", topk > 1),
        ("speculative.adaptive-steps", steps not in (1, 3, 5, 7)),
        ("speculative.adaptive-attention-dp", attention_dp > 1),
    ) if adaptive and applies}
    assert {rule for rule in fired if "adaptive" in rule} == expected
    assert ("speculative.ngram-tree" in fired) == (algorithm == "NGRAM")  # NGRAM stays refused on its own


def test_adaptive_chain_of_three_passes_and_each_refusal_names_its_field():
    assert validate_recipe(make_recipe(spec__speculative=ADAPTIVE_CHAIN)) == []
    offload = {"spec__hardware": {"profile": "h100"},
               "spec__model": {"path": "MiniMaxAI/MiniMax-M3-MXFP8", "variant": "mxfp8"},
               "spec__parallelism": {"tp": 8, "ep": 1},
               # 100 blocks hold a chain of 3 (4 tokens x 1 KV head x top-16) but not adaptive's longest, 7 (128)
               "spec__hostOffload": {"mode": "sparse-offload", "sizeGbPerRank": 64, "cacheBlocks": 100}}
    cases = {
        "speculative.adaptive-tree": ("spec.speculative.adaptive", {"spec__speculative__eagleTopk": 2}),
        "speculative.adaptive-steps": ("spec.speculative.numSteps",
                                       {"spec__speculative__numSteps": 4, "spec__speculative__numDraftTokens": 5}),
        "speculative.adaptive-attention-dp": ("spec.speculative.adaptive",
                                              {"spec__parallelism": {"tp": 8, "ep": 8, "attentionDp": 2}}),
        "speculative.adaptive-algorithm": ("spec.speculative.adaptive", {"spec__speculative__algorithm": "NGRAM",
                                                                         "spec__speculative__draftModel": None}),
        "offload.cache-blocks-min": ("spec.hostOffload.cacheBlocks", offload),
        "speculative.adaptive-extra-args": ("spec.serving.extraArgs[2]",
                                            {"spec__serving__extraArgs": ["--log-level", "info", "--enable-pdmux"]}),
    }
    for rule, (field, changes) in cases.items():
        recipe = make_recipe(spec__speculative={**ADAPTIVE_CHAIN}, **changes)  # a copy: changes edit it
        refusals = [(f.severity, f.field) for f in validate_recipe(recipe) if f.rule == rule]
        assert refusals == [("error", field)], rule
        without = make_recipe(spec__speculative={**ADAPTIVE_CHAIN, "adaptive": False}, **changes)
        assert rule not in rules_fired(without), rule
    steps = make_recipe(spec__speculative={**ADAPTIVE_CHAIN, "numSteps": 2, "numDraftTokens": 3})
    assert any("1, 3, 5, 7" in f.message for f in validate_recipe(steps) if f.rule == "speculative.adaptive-steps")


@pytest.mark.parametrize("argument", ["--enable-multi-layer-eagle", "--enable-two-batch-overlap", "--enable-pdmux",
                                      "--enable-two-batch"])
def test_adaptive_is_refused_beside_the_extra_args_under_which_sglang_drops_it(argument):
    """SGLang 0.5.23 turns adaptive off (a log warning) under multi-layer EAGLE, two-batch overlap and
    pdmux; a recipe reaches those only through extraArgs, also abbreviated as argparse allows."""
    extra = ["--watchdog-timeout", "600", argument]
    recipe = make_recipe(spec__speculative={**ADAPTIVE_CHAIN}, spec__serving__extraArgs=extra)
    refusals = [f for f in validate_recipe(recipe) if f.rule == "speculative.adaptive-extra-args"]
    assert [(f.severity, f.field) for f in refusals] == [("error", "spec.serving.extraArgs[2]")]
    assert refusals[0].message.startswith(next(flag for flag in ADAPTIVE_DROPPED_BY if flag.startswith(argument)))
    fixed = make_recipe(spec__speculative={**ADAPTIVE_CHAIN, "adaptive": False}, spec__serving__extraArgs=extra)
    assert "speculative.adaptive-extra-args" not in rules_fired(fixed)


def test_draft_trees_follow_the_dense_attention_backend():
    """M3's sparse layers verify EAGLE trees everywhere (the CPU platform's torch path:
    tests/speculative/test_eagle3_exact.py; the Triton kernels: tests/kernels/test_msa_tree_verify.py);
    the dense layers need an SGLang backend that verifies trees at page size 128: fa3 on Hopper and
    triton on AMD do, Blackwell's fa4 and trtllm_mha do not."""
    tree = {"algorithm": "EAGLE3", "draftModel": {"path": "/drafts/tiny-eagle3"}, "numSteps": 3,
            "eagleTopk": 3, "numDraftTokens": 8}
    cpu = make_recipe(spec__hardware={"profile": "cpu"}, spec__model={"path": "sglang-m3:tiny", "variant": "bf16"},
                      spec__kvCache={"pageSize": 1}, spec__serving={"maxTotalTokens": 8192}, spec__speculative=tree)
    assert not {r for r in rules_fired(cpu) if r.startswith("speculative.")}
    bf16 = {"path": "MiniMaxAI/MiniMax-M3", "variant": "bf16"}
    for profile in ("h100", "h200", "mi300x"):
        gpu = make_recipe(spec__hardware={"profile": profile}, spec__model=bf16, spec__speculative=tree)
        assert "speculative.tree-attention-backend" not in rules_fired(gpu), profile
    assert "speculative.tree-attention-backend" in rules_fired(make_recipe(spec__speculative=tree))  # b200: fa4
    fp8_kv = make_recipe(spec__kvCache={"dtype": "fp8_e4m3"}, spec__speculative=tree)  # b200: trtllm_mha
    assert any("trtllm_mha" in f.message for f in validate_recipe(fp8_kv) if f.rule == "speculative.tree-attention-backend")


def test_amd_mxfp8_on_cdna3_wants_a_long_watchdog():
    mi300 = dict(spec__hardware={"profile": "mi300x"})
    assert "amd.mxfp8-watchdog" in rules_fired(make_recipe(**mi300))
    assert "amd.mxfp8-watchdog" not in rules_fired(
        make_recipe(**mi300, spec__serving={"watchdogTimeout": 3600}))
    assert "amd.mxfp8-watchdog" not in rules_fired(make_recipe(spec__hardware={"profile": "mi355x"}))


def test_tp_across_nodes_warns_except_inside_an_nvl72_rack():
    spread = dict(spec__parallelism={"tp": 16, "ep": 16}, spec__hardware__nodes=2)
    assert "parallelism.tp-across-nodes" in rules_fired(make_recipe(**spread))
    rack = make_recipe(spec__hardware={"profile": "gb200", "nodes": 4},
                       spec__parallelism={"tp": 16, "ep": 16})
    assert "parallelism.tp-across-nodes" not in rules_fired(rack)


def test_other_warnings_and_errors():
    assert "kv.fp8-e5m2" in rules_fired(make_recipe(spec__kvCache={"dtype": "fp8_e5m2"}))
    assert "parsers.reasoning" in rules_fired(make_recipe(spec__parsers={"reasoning": NO_PARSER}))
    assert "parsers.reasoning" not in rules_fired(make_recipe(
        spec__parsers={"reasoning": NO_PARSER, "defaultThinkingMode": "disabled"}))
    assert "parallelism.pp-uneven" in rules_fired(make_recipe(
        spec__hardware={"profile": "b200", "gpusPerNode": 7},
        spec__parallelism={"tp": 1, "pp": 7}))
    assert "model.variant-path" in rules_fired(make_recipe(
        spec__model={"path": "MiniMaxAI/MiniMax-M3-MXFP8", "variant": "bf16"}))
    assert "model.tiny-on-gpu" in rules_fired(make_recipe(
        spec__model={"path": "sglang-m3:tiny", "variant": "mxfp8"}))
    assert "provenance.sglang-version" in rules_fired(make_recipe(
        spec__provenance={"source": "x", "verified": {"hardware": "8x B200",
                                                      "sglangVersion": "0.5.9",
                                                      "date": "2026-06-01"}}))
    assert "offload.mode-field" in rules_fired(make_recipe(
        spec__hostOffload={"mode": "hisparse", "sizeGbPerRank": 10}))
    assert "serving.mem-fraction" in rules_fired(make_recipe(
        spec__serving={"memFractionStatic": 0.97, "maxRunningRequests": 1}))


@settings(max_examples=150, deadline=None)
@given(profile=st.sampled_from(sorted(CATALOG)), tp=st.integers(1, 64), pp=st.integers(1, 70),
       context=st.integers(1, 2_000_000), page=st.integers(1, 256),
       fraction=st.floats(0.01, 0.99), running=st.integers(1, 4096))
def test_every_finding_names_a_spec_field_and_a_fix(profile, tp, pp, context, page, fraction,
                                                     running):
    recipe = make_recipe(spec__hardware={"profile": profile}, spec__contextLength=context,
                         spec__parallelism={"tp": tp, "pp": pp, "ep": 1},
                         spec__kvCache={"pageSize": page},
                         spec__serving={"memFractionStatic": fraction,
                                        "maxRunningRequests": running})
    for finding in validate_recipe(recipe):
        assert finding.severity in ("error", "warning")
        assert finding.field.startswith("spec.")
        assert len(finding.message) > 20 and finding.rule


@settings(max_examples=100, deadline=None)
@given(cap=st.integers(1, 2_000_000), context=st.integers(1, 1_048_576))
def test_max_total_tokens_rule_fires_exactly_below_the_context(cap, context):
    recipe = make_recipe(spec__contextLength=context,
                         spec__serving={"maxTotalTokens": cap, "maxRunningRequests": 1,
                                        "chunkedPrefillSize": -1})
    assert ("serving.max-total-tokens" in rules_fired(recipe)) == (cap < context)


# --- rules that mirror the server's own start-up refusals --------------------------------------

def test_recipe_limits_are_the_servers():
    """The recipe layer keeps its own copies (it must import without torch); they must agree."""
    from msa_kernels.plan import DraftTree

    from sglang.srt.speculative.adaptive_spec_params import resolve_candidate_steps_from_config

    from sglang_m3.quant.mxfp8 import BLOCK
    from sglang_m3.recipe.rules import ADAPTIVE_START_STEPS, MAX_DRAFT_TREE_TOKENS, MXFP8_SCALE_GROUP

    assert MAX_DRAFT_TREE_TOKENS == DraftTree.MAX_TOKENS
    assert MXFP8_SCALE_GROUP == BLOCK
    # SGLang's default adaptive candidates, less 0 (no draft), which numSteps' minimum of 1 excludes
    assert ADAPTIVE_START_STEPS == tuple(steps for steps in resolve_candidate_steps_from_config() if steps >= 1)


@settings(max_examples=100, deadline=None)
@given(dp=st.integers(1, 4), attention_dp=st.sampled_from([1, 2, 4]), nodes=st.integers(1, 3))
def test_data_parallel_rules_fire_exactly_where_sglang_refuses(dp, attention_dp, nodes):
    recipe = make_recipe(spec__hardware={"profile": "b300", "gpusPerNode": 8, "nodes": nodes},
                         spec__parallelism={"tp": 4, "ep": 4, "dp": dp, "attentionDp": attention_dp})
    fired = rules_fired(recipe)
    assert ("parallelism.attention-dp-unsupported" in fired) == (attention_dp > 1)
    assert ("parallelism.dp-with-attention-dp" in fired) == (dp > 1 and attention_dp > 1)
    assert ("parallelism.dp-multi-node" in fired) == (dp > 1 and nodes > 1)


@settings(max_examples=100, deadline=None)
@given(tp=st.sampled_from([1, 2, 4, 8, 16, 32, 64, 128]), ep_share=st.sampled_from([1, 2, 4, 8, 16, 32, 64, 128]),
       profile=st.sampled_from(["b200", "gb200", "mi355x"]))
def test_mxfp8_rule_fires_exactly_when_a_rank_holds_part_of_a_scale_group(tp, ep_share, profile):
    ep = min(ep_share, tp)
    recipe = make_recipe(spec__hardware={"profile": profile, "gpusPerNode": min(tp, 4 if profile == "gb200" else 8),
                                         "nodes": max(1, tp // (4 if profile == "gb200" else 8))},
                         spec__parallelism={"tp": tp, "ep": ep}, spec__serving={"watchdogTimeout": 3600})
    # M3: routed and shared intermediate 3072, dense 12288, attention output 64 x 128
    whole = all((width // ranks) % 32 == 0 and width % ranks == 0
                for width, ranks in ((3072, tp // ep), (3072, tp), (12288, tp), (8192, tp)))
    expected = CATALOG[profile].vendor == "nvidia" and not whole
    assert ("parallelism.mxfp8-scale-groups" in rules_fired(recipe)) == expected


@settings(max_examples=100, deadline=None)
@given(tp=st.sampled_from([1, 2, 4, 8]), blocks=st.integers(1, 400),
       draft_tokens=st.one_of(st.none(), st.integers(2, 6)))
def test_sparse_offload_block_cache_must_hold_one_requests_selection(tp, blocks, draft_tokens):
    speculative = None if draft_tokens is None else {
        "algorithm": "EAGLE3", "numSteps": draft_tokens - 1, "numDraftTokens": draft_tokens,
        "draftModel": {"path": "Inferact/MiniMax-M3-EAGLE3"}}
    recipe = make_recipe(spec__hardware={"profile": "h100", "gpusPerNode": tp},
                         spec__model={"path": "MiniMaxAI/MiniMax-M3-MXFP8", "variant": "mxfp8"},
                         spec__parallelism={"tp": tp, "ep": 1}, spec__speculative=speculative,
                         spec__hostOffload={"mode": "sparse-offload", "sizeGbPerRank": 64, "cacheBlocks": blocks})
    # the server's count (sglang_m3/cache/offload_settings.py): query tokens x KV heads per rank x top-16
    needed = (draft_tokens or 1) * max(1, 4 // tp) * 16
    assert ("offload.cache-blocks-min" in rules_fired(recipe)) == (blocks < needed)


def test_pipeline_parallel_speculation_is_refused():
    """The model refuses a draft under --pp-size > 1 at start-up (MiniMaxM3SparseForCausalLM), with
    or without SGLang's pipeline relay of EAGLE drafts."""
    draft = {"path": "Inferact/MiniMax-M3-EAGLE"}
    pp2 = {"spec__hardware": {"profile": "h100", "nodes": 2},
           "spec__model": {"path": "MiniMaxAI/MiniMax-M3-MXFP8", "variant": "mxfp8"},
           "spec__parallelism": {"tp": 8, "pp": 2}}
    for algorithm, env in (("EAGLE3", {}), ("EAGLE", {}), ("EAGLE", {"SGLANG_ENABLE_PP_SPEC": "1"})):
        recipe = make_recipe(**pp2, spec__speculative={"algorithm": algorithm, "draftModel": draft}, spec__env=env)
        refusals = [(f.severity, f.field) for f in validate_recipe(recipe) if f.rule == "speculative.pipeline"]
        assert refusals == [("error", "spec.speculative.algorithm")], (algorithm, env)
    assert "speculative.pipeline" not in rules_fired(make_recipe(**pp2))


def test_cpu_profile_serves_two_ranks():
    """README: the CPU platform serves --tp-size 2 (and with --ep-size 2); a recipe can say so."""
    base = {"spec__model": {"path": "sglang-m3:tiny", "variant": "bf16"}, "spec__contextLength": 4096,
            "spec__kvCache": {"pageSize": 1},
            "spec__serving": {"maxTotalTokens": 8192, "maxRunningRequests": 4, "chunkedPrefillSize": 1024}}
    two = make_recipe(**base, spec__hardware={"profile": "cpu", "gpusPerNode": 2}, spec__parallelism={"tp": 2, "ep": 2})
    assert [f for f in validate_recipe(two) if f.severity == "error"] == []
    four = make_recipe(**base, spec__hardware={"profile": "cpu", "gpusPerNode": 4}, spec__parallelism={"tp": 4})
    assert "cpu.ranks" in rules_fired(four)


def test_parser_names_are_sglangs():
    from sglang.srt.server_args import _reasoning_parser_choices, _tool_call_parser_choices

    import sglang_m3.plugin  # noqa: F401  (registers minimax-m3 where SGLang lists parsers)
    from sglang_m3.parsers.serving_hooks import PARSER_ALIASES
    from sglang_m3.recipe.rules import SGLANG_REASONING_PARSERS, SGLANG_TOOL_CALL_PARSERS

    # the plugin's own aliases join SGLang's lists once its parsers are registered (another test
    # in the same process may have done so); the rules take them as M3's parser, not SGLang's
    ours = set(PARSER_ALIASES)
    assert SGLANG_REASONING_PARSERS == {"auto", *_reasoning_parser_choices()} - ours
    assert SGLANG_TOOL_CALL_PARSERS == {"auto", *_tool_call_parser_choices()} - ours


def test_parser_names_outside_sglang_are_refused_and_other_models_parsers_warned():
    typo = make_recipe(spec__parsers={"reasoning": "minimax-m2x", "toolCall": "minimax-m3"})
    found = {(f.severity, f.field, f.rule) for f in validate_recipe(typo)}
    assert ("error", "spec.parsers.reasoning", "parsers.unknown") in found
    other = make_recipe(spec__parsers={"reasoning": "minimax-m3", "toolCall": "minimax-m2"})
    found = {(f.severity, f.field, f.rule) for f in validate_recipe(other)}
    assert ("warning", "spec.parsers.toolCall", "parsers.other-model") in found
    assert not {r for r in rules_fired(make_recipe()) if r.startswith("parsers.")}


def test_the_plugins_parser_alias_is_m3s_parser():
    """The plugin registers ``minimax_m3`` beside ``minimax-m3`` (a server accepts both flags), so a
    recipe naming it is neither refused as unknown nor warned as another model's parser."""
    alias = make_recipe(spec__parsers={"reasoning": "minimax_m3", "toolCall": "minimax_m3"})
    assert not {r for r in rules_fired(alias) if r.startswith("parsers.")}
