"""Audit findings in the recipe layer: inputs not shaped like the library's recipes.

Each test states what an experienced SGLang + Kubernetes user expects: a recipe the API server
or SGLang 0.5.23 would refuse is refused by ``recipe validate`` naming its YAML path (instead
of being accepted, or crashing), one they accept is accepted, and the rendered command line is
the one SGLang's own parser reads back faithfully.
"""

from __future__ import annotations

import copy
import json

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_m3.recipe import (
    RecipeLoadError,
    estimate_fit,
    load_recipe_text,
    parse_recipe,
    render_launch,
    validate_recipe,
)
from tests.recipe.cli_runner import run_cli
from tests.recipe.recipe_factory import BASE, REPO, recipe_document

BASE_TEXT = yaml.safe_dump(BASE, sort_keys=False)


def errors(recipe) -> list[tuple[str, str]]:
    return [(f.field, f.rule) for f in validate_recipe(recipe) if f.severity == "error"]


def load_problems(document=None, text: str | None = None) -> list[tuple[str, str]]:
    with pytest.raises(RecipeLoadError) as refused:
        if text is not None:
            load_recipe_text(text, source="<audit>")
        else:
            parse_recipe(document, source="<audit>")
    return [(p.field, p.message) for p in refused.value.problems]


# --- scalars as the CRD takes them -------------------------------------------------------------

@pytest.mark.parametrize("changes, field", [
    ({"spec__parallelism": {"tp": "8", "ep": 8}}, "spec.parallelism.tp"),
    ({"spec__parallelism": {"tp": 8, "ep": True}}, "spec.parallelism.ep"),
    ({"spec__contextLength": "131072"}, "spec.contextLength"),
    ({"spec__serving": {"memFractionStatic": "0.8"}}, "spec.serving.memFractionStatic"),
    ({"spec__serving": {"port": "30000"}}, "spec.serving.port"),
    ({"spec__serving": {"watchdogTimeout": float("inf")}}, "spec.serving.watchdogTimeout"),
    ({"spec__multimodal": {"media": {"videoFps": float("inf")}}}, "spec.multimodal.media.videoFps"),
    ({"spec__serving": {"maxRunningRequests": 2**63}}, "spec.serving.maxRunningRequests"),
    ({"spec__serving": {"maxTotalTokens": 1e300}}, "spec.serving.maxTotalTokens"),
    ({"spec__model": {"path": "MiniMaxAI/MiniMax-M3-MXFP8", "variant": "mxfp8", "trustRemoteCode": "yes"}},
     "spec.model.trustRemoteCode"),
    ({"spec__model": {"path": "MiniMaxAI/MiniMax-M3-MXFP8", "variant": "mxfp8", "trustRemoteCode": 1}},
     "spec.model.trustRemoteCode"),
    ({"spec__multimodal": {"enabled": "false"}}, "spec.multimodal.enabled"),
    ({"spec__model": {"path": b"MiniMaxAI/MiniMax-M3-MXFP8", "variant": "mxfp8"}}, "spec.model.path"),
])
def test_scalars_the_crd_refuses_are_refused_naming_the_field(changes, field):
    """The CRD types these fields (integer, number, boolean, string); the API server refuses
    "8" for tp and "yes" for trustRemoteCode, and can store neither .inf nor more than int64.
    pydantic's lax mode converted them, so the CLI accepted what kubectl apply refuses."""
    problems = load_problems(recipe_document(**changes))
    assert [f for f, _ in problems] == [field], problems


def test_whole_floats_and_plain_numbers_are_still_accepted():
    recipe = parse_recipe(recipe_document(spec__parallelism={"tp": 8.0, "ep": 8},
                                          spec__serving={"memFractionStatic": 0.8, "maxRunningRequests": 8,
                                                         "watchdogTimeout": 3600}))
    assert recipe.spec.parallelism.tp == 8 and recipe.spec.serving.watchdog_timeout == 3600.0
    assert errors(recipe) == []


@settings(max_examples=80, deadline=None)
@given(value=st.one_of(st.integers(1, 2**40).map(str), st.booleans(), st.floats(allow_nan=False).map(str)))
def test_no_integer_field_takes_text_or_booleans(value):
    for field in ("tp", "pp", "dp", "ep", "attentionDp"):
        document = recipe_document()
        document["spec"]["parallelism"] = {**document["spec"]["parallelism"], field: value}
        assert [f for f, _ in load_problems(document)] == [f"spec.parallelism.{field}"]


# --- YAML edge cases ---------------------------------------------------------------------------

def with_line(text: str, after: str, line: str) -> str:
    assert after in text
    return text.replace(after, after + line, 1)


@pytest.mark.parametrize("text, field, words", [
    # the resolver takes these for timestamps; they are no dates: a field error, not a crash
    (BASE_TEXT.replace("spec:\n", "spec:\n  provenance2: 2025-13-01\n", 1), "spec.provenance2", "unknown field"),
    (with_line(BASE_TEXT, "  provenance:\n", "    verified: {hardware: x, sglangVersion: 0.5.23, date: 2025-02-30}\n"),
     "spec.provenance.verified.date", "valid date"),
    (with_line(BASE_TEXT, "  provenance:\n", "    verified: {hardware: x, sglangVersion: 0.5.23, date: !!timestamp soon}\n"),
     "spec.provenance.verified.date", "valid date"),
    (BASE_TEXT.replace("spec:\n", "spec:\n  ? [a, b]\n  : c\n", 1), "<yaml>", "a list cannot be a key"),
    (BASE_TEXT.replace("spec:\n", "spec:\n  someCount: !!int many\n", 1), "<yaml>", "cannot read this value as int"),
    (BASE_TEXT.replace("spec:\n", "spec:\n  env: " + "[" * 3000 + "]" * 3000 + "\n", 1), "<yaml>", "nested too deeply"),
])
def test_malformed_yaml_values_are_refused_not_crashes(text, field, words):
    problems = load_problems(text=text)
    assert any(f == field and words in m for f, m in problems), problems


def test_an_impossible_date_is_a_field_error_in_the_cli(tmp_path, capsys):
    path = tmp_path / "recipe.yaml"
    path.write_text(with_line(BASE_TEXT, "  provenance:\n",
                              "    verified: {hardware: x, sglangVersion: 0.5.23, date: 2025-13-01}\n"))
    code, out, _ = run_cli(capsys, "validate", str(path), "--output", "json")
    [result] = json.loads(out)
    assert code == 1 and [p["field"] for p in result["problems"]] == ["spec.provenance.verified.date"]


class CountingLeaf:
    """A leaf whose repr counts how often an error message looked at it."""

    calls = 0

    def __repr__(self) -> str:
        CountingLeaf.calls += 1
        return "leaf"


def test_alias_bombs_are_quoted_without_walking_them():
    """YAML aliases make a few hundred bytes decode to billions of shared elements; quoting the
    value in the error walked every one of them (a 12-level file never finished loading). The
    quote now looks at a bounded part: here at most a few hundred of a million leaves."""
    shared = [CountingLeaf()] * 10
    for _ in range(5):
        shared = [shared] * 10  # 10^6 leaves, one object
    CountingLeaf.calls = 0
    problems = load_problems(recipe_document(spec__env=shared))
    assert [f for f, _ in problems] == ["spec.env"]
    assert CountingLeaf.calls < 1000 and len(problems[0][1]) < 200


def test_merge_keys_work_as_in_kubernetes_manifests():
    """``<<: *anchor`` is YAML Kubernetes reads; keys written beside it override the merged ones,
    and only a key written twice in one mapping is a duplicate."""
    text = BASE_TEXT.replace("spec:\n", "x-defaults: &parallel {tp: 4, ep: 2}\nspec:\n", 1)
    document = yaml.safe_load(text)
    assert document["spec"]["parallelism"] == {"tp": 8, "ep": 8}
    merged = text.replace("  parallelism:\n    tp: 8\n    ep: 8\n", "  parallelism:\n    <<: *parallel\n    ep: 8\n    tp: 8\n")
    assert merged != text
    problems = load_problems(text=merged)  # only the top-level helper key is unknown
    assert [f for f, _ in problems] == ["x-defaults"]
    inline = BASE_TEXT.replace("  parallelism:\n    tp: 8\n    ep: 8\n", "  parallelism:\n    <<: {tp: 4, ep: 2}\n    ep: 8\n    tp: 8\n")
    recipe = load_recipe_text(inline)
    assert (recipe.spec.parallelism.tp, recipe.spec.parallelism.ep) == (8, 8)
    twice = inline.replace("    ep: 8\n    tp: 8\n", "    ep: 8\n    tp: 8\n    tp: 4\n")
    assert any("duplicate key 'tp'" in m for _, m in load_problems(text=twice))


# --- what SGLang 0.5.23 refuses at start-up ------------------------------------------------------

MXFP8 = {"path": "MiniMaxAI/MiniMax-M3-MXFP8", "variant": "mxfp8"}


@pytest.mark.parametrize("model, field", [
    ({**MXFP8, "servedModelName": "minimax:m3"}, "spec.model.servedModelName"),
    ({"path": "registry.local/minimax:mxfp8", "variant": "mxfp8"}, "spec.model.path"),
])
def test_a_served_model_name_with_a_colon_is_refused(model, field):
    """SGLang's check_server_args: served_model_name (the path when unset) may not hold ':'."""
    assert (field, "model.served-name-colon") in errors(parse_recipe(recipe_document(spec__model=model)))


@pytest.mark.parametrize("model", [
    {**MXFP8, "servedModelName": "minimax-m3"},
    {"path": "registry.local/minimax:mxfp8", "variant": "mxfp8", "servedModelName": "minimax-m3"},
    {"path": "s3://models/minimax-m3-mxfp8", "variant": "mxfp8"},
])
def test_names_without_a_colon_pass(model):
    assert not [e for e in errors(parse_recipe(recipe_document(spec__model=model)))
                if e[1] == "model.served-name-colon"]


def test_the_served_name_rule_agrees_with_sglang():
    pytest.importorskip("sglang.srt.server_args")
    from sglang.srt.arg_groups.validation_hook import check_server_args
    from sglang.srt.server_args import prepare_server_args

    for model in ({**MXFP8, "servedModelName": "minimax:m3"}, {**MXFP8, "servedModelName": "minimax-m3"}):
        recipe = parse_recipe(recipe_document(spec__model=model))
        server_args = prepare_server_args(render_launch(recipe).argv)
        refused = ("spec.model.servedModelName", "model.served-name-colon") in errors(recipe)
        try:
            check_server_args(server_args)
        except AssertionError as error:
            assert refused and "colon" in str(error)
        except Exception:  # later checks need a resolved configuration; the colon check came first
            assert not refused


@pytest.mark.parametrize("chunk, page, refused", [
    (1000, 128, True), (8192, 128, False), (-1, 128, False), (0, 128, False), (1000, 1, False),
])
def test_chunked_prefill_must_be_whole_pages(chunk, page, refused):
    """check_server_args: chunked_prefill_size % page_size == 0 when chunking is on."""
    changes = {"spec__serving": {"memFractionStatic": 0.8, "maxRunningRequests": 8, "chunkedPrefillSize": chunk}}
    if page == 1:  # pages of one token: the CPU profile
        changes.update(spec__hardware={"profile": "cpu"}, spec__parallelism={"tp": 1},
                       spec__model={"path": "sglang-m3:tiny", "variant": "bf16"}, spec__contextLength=4096,
                       spec__serving={"maxTotalTokens": 8192, "chunkedPrefillSize": chunk})
    changes["spec__kvCache"] = {"pageSize": page}
    found = errors(parse_recipe(recipe_document(**changes)))
    assert (("spec.serving.chunkedPrefillSize", "context.chunk-page") in found) == refused, found


@pytest.mark.parametrize("nodes, per_node, tp, pp, refused", [
    (2, 6, 4, 3, True),     # SGLang launches stages 0 and 1 only
    (4, 6, 4, 6, True),
    (2, 8, 8, 2, False),    # one stage per node
    (2, 8, 4, 4, False),    # two stages per node
    (4, 4, 8, 2, False),    # each stage's TP group over two nodes
])
def test_pipeline_stages_must_map_onto_nodes(nodes, per_node, tp, pp, refused):
    recipe = parse_recipe(recipe_document(
        spec__hardware={"profile": "h200", "nodes": nodes, "gpusPerNode": per_node},
        spec__model={"path": "MiniMaxAI/MiniMax-M3", "variant": "bf16"},
        spec__parallelism={"tp": tp, "pp": pp}))
    found = errors(recipe)
    assert (("spec.hardware.nodes", "parallelism.node-layout") in found) == refused, found


def sglang_ranks_launched(nodes: int, tp: int, pp: int) -> set[tuple[int, int]]:
    """(pp rank, tp rank) pairs SGLang 0.5.23's _calculate_rank_ranges starts over all nodes."""
    from sglang.srt.entrypoints import engine

    class Parallel:
        pass

    parallel = Parallel()
    parallel.nnodes, parallel.pp_size, parallel.tp_size = nodes, pp, tp
    original = engine.get_parallel
    engine.get_parallel = lambda: parallel
    try:
        launched = set()
        for node in range(nodes):
            pp_ranks, tp_ranks, _, _ = engine._calculate_rank_ranges(node)
            launched |= {(p, t) for p in pp_ranks for t in tp_ranks}
        return launched
    finally:
        engine.get_parallel = original


@pytest.mark.parametrize("nodes", [2, 3, 4, 6])
@pytest.mark.parametrize("pp", [2, 3, 4, 6])
def test_the_node_layout_rule_is_sglangs(nodes, pp):
    """Differential: the rule refuses exactly the layouts where SGLang's own rank placement
    misses a (stage, rank) pair or places one outside the model."""
    pytest.importorskip("sglang.srt.entrypoints.engine")
    tp = nodes  # tp x pp GPUs make pp GPUs on each node
    launched = sglang_ranks_launched(nodes, tp, pp)
    whole = launched == {(p, t) for p in range(pp) for t in range(tp)}
    recipe = parse_recipe(recipe_document(
        spec__hardware={"profile": "h200", "nodes": nodes, "gpusPerNode": tp * pp // nodes},
        spec__model={"path": "MiniMaxAI/MiniMax-M3", "variant": "bf16"},
        spec__parallelism={"tp": tp, "pp": pp}))
    refused = ("spec.hardware.nodes", "parallelism.node-layout") in errors(recipe)
    assert refused == (not whole), (nodes, tp, pp, launched)


H200_TREE = {"spec__hardware": {"profile": "h200"}, "spec__parallelism": {"tp": 8},
             "spec__model": {"path": "MiniMaxAI/MiniMax-M3", "variant": "bf16"}}


def tree(topk: int, steps: int, tokens: int):
    return parse_recipe(recipe_document(**H200_TREE, spec__speculative={
        "algorithm": "EAGLE3", "draftModel": {"path": "Inferact/MiniMax-M3-EAGLE3"},
        "eagleTopk": topk, "numSteps": steps, "numDraftTokens": tokens}))


def sglang_organizes(topk: int, steps: int, tokens: int) -> bool:
    """Whether SGLang's EAGLE draft step can pick ``tokens - 1`` of a tree's candidates."""
    import torch
    from sglang.srt.speculative.eagle_utils import organize_draft_results

    scores = [torch.rand(1, 1, topk)] + [torch.rand(1, topk, topk) for _ in range(steps - 1)]
    tokens_list = [torch.zeros(1, topk, dtype=torch.long)] + [
        torch.zeros(1, topk * topk, dtype=torch.long) for _ in range(steps - 1)]
    parents = [torch.zeros(1, topk + 1, dtype=torch.long)] + [
        torch.zeros(1, topk, dtype=torch.long) for _ in range(steps - 1)]
    try:
        organize_draft_results(scores, tokens_list, parents, tokens)
    except RuntimeError:
        return False
    return True


@pytest.mark.parametrize("topk, steps", [(2, 1), (2, 3), (3, 2), (4, 1), (4, 2)])
def test_draft_trees_offer_enough_candidates_as_sglang_counts_them(topk, steps):
    pytest.importorskip("sglang.srt.speculative.eagle_utils")
    verdicts = []
    for tokens in range(2, 40):
        refused = ("spec.speculative.numDraftTokens", "speculative.tree-candidates") in errors(tree(topk, steps, tokens))
        assert refused == (not sglang_organizes(topk, steps, tokens)), (topk, steps, tokens)
        verdicts.append(refused)
    assert verdicts[0] is False and verdicts[-1] is True  # both sides of the boundary were seen


# --- env, fit, rendering -----------------------------------------------------------------------

@pytest.mark.parametrize("name, refused", [
    ("NCCL_DEBUG", False), ("_PRIVATE", False), ("1ST", True), ("WITH SPACE", True), ("", True),
    ("A=B", True), ("DOT.TED", True), ("TRAILING\n", True),
])
def test_env_names_must_be_variable_names(name, refused):
    """The field names the key as a key: ``spec.env["my.var"]`` is one entry, where
    ``spec.env.my.var`` read as a path to a field ``var`` (and ``spec.env.`` as no name at all)."""
    found = errors(parse_recipe(recipe_document(spec__env={name: "1"})))
    assert ((f"spec.env[{json.dumps(name)}]", "env.name") in found) == refused, found
    assert [field for field, rule in found if rule == "env.name"] == ([f"spec.env[{json.dumps(name)}]"] if refused else [])


CPU_TINY = yaml.safe_load((REPO / "recipes" / "cpu-tiny.yaml").read_text())


@pytest.mark.parametrize("document", [recipe_document(), CPU_TINY], ids=["b200", "cpu"])
@pytest.mark.parametrize("platform", ["sglang_m3_cpu", "cuda_oot", ""])
def test_the_platform_is_the_renderers_not_envs(document, platform):
    """``SGLANG_PLATFORM`` in env selected the torch CPU platform on a GPU node, or replaced the cpu
    profile's own (``env.update(spec.env)`` wins), with no finding: the renderer owns it."""
    document = copy.deepcopy(document)
    document["spec"]["env"] = {"SGLANG_PLATFORM": platform}
    recipe = parse_recipe(document)
    assert ("spec.env.SGLANG_PLATFORM", "env.platform") in errors(recipe)
    message = next(f.message for f in validate_recipe(recipe) if f.rule == "env.platform")
    assert "hardware.profile" in message and "remove it from env" in message


@pytest.mark.parametrize("name, value, refused", [
    ("SGLANG_M3_SPARSE_OFFLOAD_LOG_STEPS", "abc", True),
    ("SGLANG_M3_SPARSE_OFFLOAD_LOG_STEPS", "-1", True),
    ("SGLANG_M3_SPARSE_OFFLOAD_LOG_STEPS", "0", False),
    ("SGLANG_M3_SPARSE_OFFLOAD_LOG_STEPS", " 50 ", False),
    ("SGLANG_M3_MOE_OVERLAP", "off", True),
    ("SGLANG_M3_MOE_OVERLAP", "0", False),
    ("SGLANG_M3_MOE_IMPL", "Fused", True),
    ("SGLANG_M3_MOE_IMPL", "fused", False),
    ("SGLANG_M3_DENSE_DECODE", "msa ", True),
    ("SGLANG_M3_FUSED_NORM", " 0", False),
    ("NCCL_DEBUG", "anything", False),
])
def test_the_plugins_switches_take_only_values_the_plugin_takes(name, value, refused):
    """``SGLANG_M3_SPARSE_OFFLOAD_LOG_STEPS: abc`` validated, and the server refused it at start-up
    (``env_switch``); each switch's value is now read as the plugin reads it, and refused by name
    with the values it takes (``test_plugin_switches`` holds the table to the plugin's readers)."""
    recipe = parse_recipe(recipe_document(spec__env={name: value}))
    assert ((f"spec.env.{name}", "env.plugin-switch") in errors(recipe)) == refused
    if refused:
        message = next(f.message for f in validate_recipe(recipe) if f.rule == "env.plugin-switch")
        assert repr(value) in message and name in message and "set " in message


def test_media_caps_with_multimodal_off_are_refused():
    """``media`` was dropped silently with ``enabled: false``, where ``limitPerRequest`` is refused."""
    recipe = parse_recipe(recipe_document(spec__multimodal={"enabled": False, "media": {"maxImageMegabytes": 1}}))
    assert errors(recipe) == [("spec.multimodal.media", "multimodal.limits-unused")]
    assert errors(parse_recipe(recipe_document(spec__multimodal={"media": {"maxImageMegabytes": 1}}))) == []


HICACHE = {"mode": "hierarchical-cache", "sizeGbPerRank": 400}


@pytest.mark.parametrize("extra_args, index", [
    (["--disable-radix-cache"], 0),
    (["--log-level", "info", "--disable-radix"], 2),  # an abbreviation SGLang expands
])
def test_hierarchical_cache_with_the_radix_cache_off_is_refused(extra_args, index):
    """SGLang refuses --enable-hierarchical-cache with --disable-radix-cache at start-up ("mutually
    exclusive"); the recipe validated, and the operator would have asked for the host memory."""
    serving = {**BASE["spec"]["serving"], "extraArgs": extra_args}
    recipe = parse_recipe(recipe_document(spec__hostOffload=HICACHE, spec__serving=serving))
    assert errors(recipe) == [(f"spec.serving.extraArgs[{index}]", "offload.hierarchical-cache-radix")]
    assert errors(parse_recipe(recipe_document(spec__serving=serving))) == []  # alone it is SGLang's business


def test_block_caches_that_eat_the_kv_budget_are_blamed_not_the_weights():
    recipe = parse_recipe(recipe_document(
        spec__hostOffload={"mode": "sparse-offload", "sizeGbPerRank": 100, "cacheBlocks": 100_000}))
    report = estimate_fit(recipe)
    assert report.weight_bytes_per_gpu < report.static_budget_bytes  # the weights fit
    found = errors(recipe)
    assert ("spec.hostOffload.cacheBlocks", "fit.block-caches") in found
    assert not [e for e in found if e[1] == "fit.weights"]


DASHED = [
    ("spec__model", {**MXFP8, "servedModelName": "-m3"}, "served_model_name", "-m3"),
    ("spec__model", {**MXFP8, "revision": "-rc1"}, "revision", "-rc1"),
    ("spec__model", {"path": "-models/m3", "variant": "mxfp8"}, "model_path", "-models/m3"),
]


@pytest.mark.parametrize("key, value, field, expected", DASHED)
def test_values_that_start_with_a_dash_reach_sglang(key, value, field, expected):
    """argparse reads a separate '-m3' as an option ("expected one argument"); the renderer
    joins such values to their flag with '='."""
    server_args_module = pytest.importorskip("sglang.srt.server_args")
    recipe = parse_recipe(recipe_document(**{key: copy.deepcopy(value)}))
    server_args = server_args_module.prepare_server_args(render_launch(recipe).argv)
    assert getattr(server_args, field) == expected


# --- sizes that stalled or crashed the checks ---------------------------------------------------

@pytest.mark.timeout(30)
@pytest.mark.parametrize("nodes, pp", [(1, 100_000), (10**12, 7), (7, 10**7)])
def test_huge_stage_and_node_counts_are_refused_promptly(nodes, pp):
    """pp = 10^5 took the memory fit 51 s (its stage split was quadratic) and larger counts
    never finished, in `recipe validate` and in the operator's webhook alike; the node layout
    rule must not walk the nodes either."""
    recipe = parse_recipe(recipe_document(spec__parallelism={"tp": 1, "pp": pp},
                                          spec__hardware={"profile": "b200", "nodes": nodes}))
    found = errors(recipe)
    assert ("spec.parallelism", "parallelism.gpu-count") in found
    if pp > 60:
        assert ("spec.parallelism.pp", "parallelism.pp-layers") in found
    if nodes > 1:
        assert ("spec.hardware.nodes", "parallelism.node-layout") in found


def test_attention_dp_above_tp_with_sparse_offload_is_refused_not_a_crash():
    """tp // attentionDp was 0 and the sparse-offload sizing divided by it (ZeroDivisionError
    in `recipe validate`, the operator and the webhook)."""
    recipe = parse_recipe(recipe_document(
        spec__parallelism={"tp": 8, "ep": 8, "attentionDp": 9},
        spec__hostOffload={"mode": "sparse-offload", "sizeGbPerRank": 64, "cacheBlocks": 4096}))
    assert ("spec.parallelism.attentionDp", "parallelism.attention-dp") in errors(recipe)


# --- property: no input crashes or stalls the checks ---------------------------------------------

FIELDS = [
    "spec__hardware__nodes", "spec__hardware__gpusPerNode", "spec__hardware__profile",
    "spec__parallelism__tp", "spec__parallelism__pp", "spec__parallelism__dp", "spec__parallelism__ep",
    "spec__parallelism__attentionDp", "spec__contextLength", "spec__kvCache__pageSize",
    "spec__kvCache__dtype", "spec__serving__chunkedPrefillSize", "spec__serving__maxRunningRequests",
    "spec__serving__maxTotalTokens", "spec__serving__memFractionStatic", "spec__serving__port",
    "spec__speculative__numSteps", "spec__speculative__eagleTopk", "spec__speculative__numDraftTokens",
    "spec__hostOffload__cacheBlocks", "spec__hostOffload__sizeGbPerRank", "spec__serving__extraArgs",
    "spec__model__servedModelName", "spec__env",
]
VALUES = st.one_of(
    st.integers(-2, 8), st.integers(0, 2**63 - 1), st.sampled_from([64, 128, 1000, 1 << 20, 1 << 40]),
    st.floats(allow_nan=True, allow_infinity=True), st.booleans(), st.none(), st.text(max_size=8),
    st.lists(st.sampled_from(["--enable-metrics", "--log-level", "info", "-1", "--x", "x"]), max_size=4),
    st.dictionaries(st.text(max_size=6), st.text(max_size=4), max_size=2),
)


@settings(max_examples=300, deadline=2000)
@given(changes=st.dictionaries(st.sampled_from(FIELDS), VALUES, min_size=1, max_size=4),
       speculative=st.booleans(), offload=st.booleans())
def test_any_document_is_refused_or_checked_quickly_never_crashes(changes, speculative, offload):
    """Whatever the values (huge counts, wrong types, nulls, infinities), loading either refuses
    the document naming fields, or validation, the memory fit and the renderer all answer, in
    time: pp = 10^5 took the fit 51 s (quadratic stages) and nodes = 10^12 would never finish."""
    document = recipe_document()
    if speculative:
        document["spec"]["speculative"] = {"algorithm": "EAGLE3", "draftModel": {"path": "Inferact/MiniMax-M3-EAGLE3"}}
    if offload:
        document["spec"]["hostOffload"] = {"mode": "sparse-offload", "sizeGbPerRank": 64, "cacheBlocks": 4096}
    for dotted, value in changes.items():
        node = document
        keys = dotted.split("__")
        for key in keys[:-1]:
            if not isinstance(node.get(key), dict):
                node[key] = {}
            node = node[key]
        node[keys[-1]] = copy.deepcopy(value)
    try:
        recipe = parse_recipe(document)
    except RecipeLoadError as error:
        assert error.problems and all(p.field.startswith(("spec", "<")) for p in error.problems)
        return
    findings = validate_recipe(recipe)
    assert all(f.field.startswith("spec.") for f in findings)
    render_launch(recipe)
    if recipe.spec.hardware.profile != "cpu":
        estimate_fit(recipe)
