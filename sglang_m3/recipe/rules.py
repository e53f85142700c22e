"""Deployment rules: everything that makes an M3 recipe fail at start-up or serve wrongly.

``validate_recipe`` runs every rule and returns all findings, so one run shows every problem.
Each rule is a small function of the recipe (and its hardware profile) that yields findings
with the field at fault and the fix; ``RULES`` lists them in the order they report.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator

from ..parsers.serving_hooks import PARSER_ALIASES
from .catalog import CATALOG, HardwareProfile, get_profile
from .findings import Finding
from .fit import estimate_fit, fit_applies
from .model_geometry import M3, MAX_CONTEXT_LENGTH, TINY_MODEL_PATH
from .plugin_switches import PLUGIN_SWITCHES
from .render import (
    CPU_PLATFORM_NAME,
    PLATFORM_ENV,
    TYPED_ENV,
    TYPED_FLAGS,
    attention_backend_for,
    sparse_offload_selection_blocks,
)
from .schema import NO_PARSER, Recipe
from .sglang_options import OPTIONS as SGLANG_OPTIONS
from .sglang_options import SGLANG_VERSION as SGLANG_OPTIONS_VERSION
from .sglang_options import is_option_token, resolve

Rule = Callable[[Recipe, HardwareProfile], Iterator[Finding]]

#: SGLang version the project pins; a recipe verified on another one gets a warning.
PINNED_SGLANG_VERSION = "0.5.23"


def _error(field: str, message: str, rule: str) -> Finding:
    return Finding("error", field, message, rule)


def _warning(field: str, message: str, rule: str) -> Finding:
    return Finding("warning", field, message, rule)


def gpus_per_node(recipe: Recipe, profile: HardwareProfile) -> int:
    """GPUs the recipe uses on each node (the profile's full node unless stated)."""
    return recipe.spec.hardware.gpus_per_node or profile.gpus_per_node


def _names(profiles) -> str:
    return ", ".join(profile.name for profile in profiles)


# --- hardware and weights ---------------------------------------------------------------------

def check_variant(recipe: Recipe, profile: HardwareProfile) -> Iterator[Finding]:
    variant = recipe.spec.model.variant
    if variant in profile.variants:
        return
    able = [p for p in CATALOG.values() if variant in p.variants and p.is_gpu]
    yield _error(
        "spec.model.variant",
        f"{variant} weights do not run on {profile.name} (it runs "
        f"{', '.join(profile.variants)}); use variant {profile.variants[0]} here, or a "
        f"profile that runs {variant}: {_names(able)}",
        "hardware.variant")


#: Ranks (gloo processes) per node with which the CPU platform serves the tiny model: tp 1 and tp 2
#: (with or without ep 2) are what its tests serve against the plain server and transformers.
CPU_MAX_RANKS = 2


def check_gpus_per_node(recipe: Recipe, profile: HardwareProfile) -> Iterator[Finding]:
    wanted = gpus_per_node(recipe, profile)
    if not profile.is_gpu:
        if wanted > CPU_MAX_RANKS:
            yield _error(
                "spec.hardware.gpusPerNode",
                f"on the cpu profile gpusPerNode counts ranks (processes on one node); the CPU "
                f"platform serves at most {CPU_MAX_RANKS}, not {wanted}; set gpusPerNode to 1 or 2",
                "cpu.ranks")
        return
    if wanted > profile.gpus_per_node:
        yield _error(
            "spec.hardware.gpusPerNode",
            f"{profile.name} nodes have {profile.gpus_per_node} GPUs, not {wanted}; set "
            f"gpusPerNode to at most {profile.gpus_per_node} and add nodes",
            "hardware.gpus-per-node")


def check_cpu_profile(recipe: Recipe, profile: HardwareProfile) -> Iterator[Finding]:
    spec = recipe.spec
    if profile.is_gpu:
        if spec.model.path == TINY_MODEL_PATH:
            yield _warning(
                "spec.model.path",
                f"{TINY_MODEL_PATH} is a tiny random-weight model for tests; its replies are "
                f"noise. Use it with hardware.profile cpu, or name real M3 weights",
                "model.tiny-on-gpu")
        return
    if spec.model.path != TINY_MODEL_PATH:
        yield _error(
            "spec.model.path",
            f"the cpu profile serves only the tiny test model; set path to {TINY_MODEL_PATH} "
            f"or choose a GPU profile for {spec.model.path}",
            "cpu.tiny-only")
    if spec.hardware.nodes > 1:
        yield _error("spec.hardware.nodes", "the cpu profile runs on one node; set nodes: 1",
                     "cpu.single-node")
    if spec.serving.max_total_tokens is None:
        yield _error(
            "spec.serving.maxTotalTokens",
            "the CPU platform does not probe memory; set maxTotalTokens (e.g. 4096)",
            "cpu.max-total-tokens")
    if spec.speculative is not None:
        yield _warning("spec.speculative",
                       "the tiny model has no draft and speculative decoding is untested on the "
                       "CPU platform; remove speculative unless you are testing exactly that",
                       "cpu.speculative")


def check_model_path_variant(recipe: Recipe, profile: HardwareProfile) -> Iterator[Finding]:
    model = recipe.spec.model
    says_mxfp8 = "mxfp8" in model.path.lower()
    if says_mxfp8 and model.variant != "mxfp8":
        yield _warning(
            "spec.model.variant",
            f"path {model.path} looks like an MXFP8 checkpoint but variant is {model.variant}; "
            f"set variant: mxfp8 (the memory fit and hardware checks follow the variant)",
            "model.variant-path")


#: URI schemes SGLang 0.5.23 streams weights from (Run:ai model streamer, ``runai_utils``); the
#: colon of such a path does not count against the served model name.
OBJECT_STORE_SCHEMES = ("s3://", "gs://", "az://")


def check_served_model_name(recipe: Recipe, profile: HardwareProfile) -> Iterator[Finding]:
    """SGLang 0.5.23 refuses a served model name with a colon at start-up (it reserves
    ``model:adapter`` for LoRA), and without ``--served-model-name`` it serves the model under
    its path."""
    model = recipe.spec.model
    if model.served_model_name is not None:
        if ":" in model.served_model_name and not model.served_model_name.lower().startswith(OBJECT_STORE_SCHEMES):
            yield _error(
                "spec.model.servedModelName",
                f"{model.served_model_name!r} has a colon, which SGLang refuses in a served model name "
                f"(it reserves 'model:adapter' for LoRA adapters); choose a name without ':'",
                "model.served-name-colon")
        return
    if (":" in model.path and model.path != TINY_MODEL_PATH
            and not model.path.lower().startswith(OBJECT_STORE_SCHEMES)):
        yield _error(
            "spec.model.path",
            f"SGLang serves the model under its path when servedModelName is unset, and refuses "
            f"{model.path!r} there for its colon (reserved for 'model:adapter' LoRA names); set "
            f"servedModelName to a name without ':'",
            "model.served-name-colon")


# --- parallelism ------------------------------------------------------------------------------

def check_gpu_count(recipe: Recipe, profile: HardwareProfile) -> Iterator[Finding]:
    parallel = recipe.spec.parallelism
    nodes = recipe.spec.hardware.nodes
    per_node = gpus_per_node(recipe, profile)
    needed = parallel.tp * parallel.pp * parallel.dp
    available = per_node * nodes
    if needed != available:
        yield _error(
            "spec.parallelism",
            f"tp x pp x dp = {parallel.tp} x {parallel.pp} x {parallel.dp} = {needed} GPUs, but "
            f"hardware gives gpusPerNode x nodes = {per_node} x {nodes} = {available}; make "
            f"them equal (change tp/pp/dp, gpusPerNode or nodes)",
            "parallelism.gpu-count")


def check_node_layout(recipe: Recipe, profile: HardwareProfile) -> Iterator[Finding]:
    """How SGLang 0.5.23 places ranks on nodes (``engine._calculate_rank_ranges``): with fewer
    nodes than pipeline stages each node runs pp / nodes whole stages, with more nodes each
    stage's TP group spans nodes / pp nodes. Any other split leaves stages no node launches
    (the group waits at start-up for ranks that never come)."""
    pp, nodes = recipe.spec.parallelism.pp, recipe.spec.hardware.nodes
    if nodes > 1 and pp > 1 and pp % nodes and nodes % pp:
        if nodes < pp:  # each node runs pp // nodes stages: the last ones are left over
            started = pp // nodes * nodes
            left = f"{started}" if started == pp - 1 else f"{started} to {pp - 1}"
            outcome = f"no node would run stage {left}, which the others wait for"
        else:  # each stage gets nodes // pp nodes: the last node counts past the last stage
            outcome = f"node {nodes - 1} would run stage {(nodes - 1) // (nodes // pp)}, which the model does not have"
        yield _error(
            "spec.hardware.nodes",
            f"{nodes} nodes for pp {pp}: SGLang puts pp / nodes whole pipeline stages on each node, or "
            f"spreads each stage over nodes / pp nodes, so one must divide the other ({outcome}); "
            f"use a node count that divides pp or a multiple of it",
            "parallelism.node-layout")


def check_data_parallel(recipe: Recipe, profile: HardwareProfile) -> Iterator[Finding]:
    parallel, nodes = recipe.spec.parallelism, recipe.spec.hardware.nodes
    if parallel.attention_dp > 1:
        yield _error(
            "spec.parallelism.attentionDp",
            f"attentionDp {parallel.attention_dp}: this plugin's M3 attention splits its heads over "
            f"the whole TP group and does not serve attention data parallelism (the server refuses "
            f"--attn-dp-size > 1); set attentionDp: 1 (dp gives whole-model replicas)",
            "parallelism.attention-dp-unsupported")
    if parallel.dp == 1:
        return
    if parallel.attention_dp > 1:
        yield _error(
            "spec.parallelism.dp",
            f"dp {parallel.dp} with attentionDp {parallel.attention_dp}: SGLang refuses data-parallel "
            f"replicas combined with attention data parallelism; keep one of them at 1",
            "parallelism.dp-with-attention-dp")
    if nodes > 1:
        yield _error(
            "spec.parallelism.dp",
            f"dp {parallel.dp} over {nodes} nodes: SGLang serves data-parallel replicas on one node "
            f"only (it refuses --dp-size > 1 with --nnodes > 1); set dp: 1 and deploy one recipe per "
            f"replica behind a router",
            "parallelism.dp-multi-node")


def check_heads(recipe: Recipe, profile: HardwareProfile) -> Iterator[Finding]:
    parallel = recipe.spec.parallelism
    if parallel.attention_dp > 1 and parallel.tp % parallel.attention_dp:
        yield _error(
            "spec.parallelism.attentionDp",
            f"attentionDp {parallel.attention_dp} must divide tp {parallel.tp} (each attention "
            f"group is tp / attentionDp ranks)",
            "parallelism.attention-dp")
        return
    attention_tp = parallel.tp // parallel.attention_dp
    heads = M3.num_query_heads
    if heads % attention_tp:
        # Every divisor of 64 also splits the 4 KV heads (and 4 index heads) evenly, or is a
        # multiple of 4 that replicates each KV head attention_tp / 4 times.
        yield _error(
            "spec.parallelism.tp" if parallel.attention_dp == 1 else "spec.parallelism",
            f"attention TP size {attention_tp} (tp / attentionDp) does not divide the {heads} "
            f"query heads; use 1, 2 or 4 (the {M3.num_kv_heads} KV heads split across ranks) "
            f"or 8, 16, 32, 64 (each KV head replicated on attention-TP / {M3.num_kv_heads} "
            f"ranks)",
            "parallelism.heads")


def check_expert_parallel(recipe: Recipe, profile: HardwareProfile) -> Iterator[Finding]:
    parallel = recipe.spec.parallelism
    experts = M3.num_routed_experts
    if parallel.tp % parallel.ep:
        yield _error(
            "spec.parallelism.ep",
            f"ep {parallel.ep} must divide tp {parallel.tp}: SGLang shards experts inside the "
            f"TP group; use ep = tp or a divisor of it",
            "parallelism.ep-divides-tp")
    elif experts % parallel.ep:
        yield _error(
            "spec.parallelism.ep",
            f"ep {parallel.ep} does not divide the {experts} routed experts; use a power of two",
            "parallelism.ep-experts")
    if profile.is_amd and parallel.ep != parallel.tp:
        yield _error(
            "spec.parallelism.ep",
            f"on AMD the published M3 recipes run expert parallelism over the whole TP group "
            f"(SGLang cookbook: --ep equal to --tp); set ep: {parallel.tp} (= tp)",
            "amd.ep-equals-tp")


#: MXFP8 stores one e8m0 scale per 32 input columns (``sglang_m3.quant.mxfp8.BLOCK``): a rank's
#: slice of a row-parallel input must hold whole scale groups, or its weights do not load.
MXFP8_SCALE_GROUP = 32


def mxfp8_row_slices(tp: int, ep: int) -> dict[str, tuple[int, int]]:
    """(width, ranks it is split over) of every row-parallel input an MXFP8 rank holds."""
    return {
        "routed experts' intermediate": (M3.moe_intermediate_size, tp // ep),
        "shared expert's intermediate": (M3.shared_intermediate_size, tp),
        "dense MLPs' intermediate": (M3.dense_intermediate_size, tp),
        "attention output (heads x head dim)": (M3.num_query_heads * M3.head_dim, tp),
    }


def check_mxfp8_scale_groups(recipe: Recipe, profile: HardwareProfile) -> Iterator[Finding]:
    parallel = recipe.spec.parallelism
    if (recipe.spec.model.variant != "mxfp8" or profile.vendor != "nvidia"
            or parallel.tp % parallel.ep or parallel.attention_dp > 1):
        return  # AMD converts MXFP8 to block FP8 at load; the other cases are other rules' errors
    for name, (width, ranks) in mxfp8_row_slices(parallel.tp, parallel.ep).items():
        if width % ranks or (width // ranks) % MXFP8_SCALE_GROUP:
            share = f"{width} / {ranks} = {width / ranks:g}"
            yield _error(
                "spec.parallelism.tp" if ranks == parallel.tp else "spec.parallelism.ep",
                f"MXFP8 weights carry one scale per {MXFP8_SCALE_GROUP} input columns, but at tp "
                f"{parallel.tp} / ep {parallel.ep} the {name} per rank is {share}, not a whole "
                f"number of scale groups, so the weights do not load; use a smaller tp"
                + (" or a larger ep" if ranks != parallel.tp else ""),
                "parallelism.mxfp8-scale-groups")
            return


def check_pipeline(recipe: Recipe, profile: HardwareProfile) -> Iterator[Finding]:
    pp = recipe.spec.parallelism.pp
    layers = M3.num_layers
    if pp > layers:
        yield _error("spec.parallelism.pp",
                     f"pp {pp} exceeds the {layers} layers; use at most {layers}",
                     "parallelism.pp-layers")
    elif layers % pp:
        yield _warning(
            "spec.parallelism.pp",
            f"{layers} layers do not split evenly over pp {pp}; the fullest stage bounds "
            f"memory and speed (2, 3, 4, 5, 6 split evenly)",
            "parallelism.pp-uneven")


def check_scale_up_domain(recipe: Recipe, profile: HardwareProfile) -> Iterator[Finding]:
    tp = recipe.spec.parallelism.tp
    if profile.is_gpu and tp > profile.scale_up_gpus:
        yield _warning(
            "spec.parallelism.tp",
            f"tp {tp} spans more than the {profile.scale_up_gpus} GPUs of one {profile.name} "
            f"NVLink/xGMI domain, so every all-reduce crosses the node network; prefer pp or "
            f"dp across nodes",
            "parallelism.tp-across-nodes")


# --- KV cache and context -------------------------------------------------------------------

def check_page_size(recipe: Recipe, profile: HardwareProfile) -> Iterator[Finding]:
    page = recipe.spec.kv_cache.page_size
    if profile.is_gpu and page != M3.sparse_block_size:
        yield _error(
            "spec.kvCache.pageSize",
            f"MSA kernels read whole {M3.sparse_block_size}-token blocks as KV pages; set "
            f"pageSize: {M3.sparse_block_size} (got {page})",
            "kv.page-size")


def check_kv_dtype(recipe: Recipe, profile: HardwareProfile) -> Iterator[Finding]:
    dtype = recipe.spec.kv_cache.dtype
    if dtype == "fp8_e5m2" and profile.architecture == "blackwell":
        yield _warning(
            "spec.kvCache.dtype",
            "fp8_e5m2 KV keeps M3's fp8 attention GEMMs off on Blackwell (sparse attention "
            "widens on the Triton path); use fp8_e4m3",
            "kv.fp8-e5m2")


def check_typed_env(recipe: Recipe, profile: HardwareProfile) -> Iterator[Finding]:
    for env, field in TYPED_ENV.items():
        if env in recipe.spec.env:
            name = field.rsplit(".", 1)[1]
            yield _error(
                f"spec.env.{env}",
                f"{env} is what {field} renders; set {name}: {recipe.spec.env[env]} instead and remove it from "
                f"env (the env value would override it unseen by these rules and the memory fit)",
                "env.typed-field")


def check_platform_env(recipe: Recipe, profile: HardwareProfile) -> Iterator[Finding]:
    if PLATFORM_ENV in recipe.spec.env:
        yield _error(
            f"spec.env.{PLATFORM_ENV}",
            f"{PLATFORM_ENV} is rendered from hardware.profile (the cpu profile selects the project's CPU "
            f"platform, {CPU_PLATFORM_NAME}; on a GPU profile SGLang detects the GPU's platform), and an env "
            f"value would override it unseen by these rules; remove it from env and choose the hardware with "
            f"hardware.profile",
            "env.platform")


def check_plugin_switches(recipe: Recipe, profile: HardwareProfile) -> Iterator[Finding]:
    for name, value in recipe.spec.env.items():
        switch = PLUGIN_SWITCHES.get(name)
        if switch is not None and not switch.accepts(value):
            yield _error(
                f"spec.env.{name}",
                f"{value!r} is not a value of the plugin's switch {name}, which the server refuses at "
                f"start-up; set {switch.expected}, or remove it for the default",
                "env.plugin-switch")


#: Environment variable names a recipe may set: what a shell (``recipe render``'s output,
#: ``sglang-m3 serve``) and a Kubernetes container both accept.
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def check_env_names(recipe: Recipe, profile: HardwareProfile) -> Iterator[Finding]:
    for name in recipe.spec.env:
        if not _ENV_NAME.fullmatch(name):
            yield _error(
                f"spec.env[{json.dumps(name, ensure_ascii=False)}]",  # a key, not a path: "my.var"
                f"{name!r} is not an environment variable name (letters, digits and '_', not starting "
                f"with a digit): Kubernetes refuses the pod and a shell cannot set it",
                "env.name")


def check_index_key_dtype(recipe: Recipe, profile: HardwareProfile) -> Iterator[Finding]:
    if recipe.spec.kv_cache.index_key_dtype == "fp8_e4m3" and profile.is_gpu and profile.vendor != "nvidia":
        yield _warning(
            "spec.kvCache.indexKeyDtype",
            f"fp8_e4m3 index keys (OCP float8_e4m3fn in the MSA Triton kernels) have only run on "
            f"NVIDIA GPUs, not on {profile.name}; verify there or keep bf16",
            "kv.index-key-fp8-vendor")


def check_context_length(recipe: Recipe, profile: HardwareProfile) -> Iterator[Finding]:
    spec = recipe.spec
    if spec.context_length > MAX_CONTEXT_LENGTH:
        yield _error(
            "spec.contextLength",
            f"{spec.context_length:,} exceeds M3's {MAX_CONTEXT_LENGTH:,}-token context; "
            f"set at most {MAX_CONTEXT_LENGTH}",
            "context.max")
    chunk = spec.serving.chunked_prefill_size
    page = spec.kv_cache.page_size
    if chunk > 0 and chunk % page:
        yield _error(
            "spec.serving.chunkedPrefillSize",
            f"chunkedPrefillSize {chunk} is not a multiple of pageSize {page}, which SGLang refuses at "
            f"start-up (chunks end on page boundaries); use {max(page, chunk // page * page)}",
            "context.chunk-page")
    if 0 < spec.context_length < chunk:
        yield _warning(
            "spec.serving.chunkedPrefillSize",
            f"chunkedPrefillSize {chunk} exceeds contextLength {spec.context_length}; set it "
            f"to at most the context length",
            "context.chunk")


# --- speculative decoding -------------------------------------------------------------------

#: Dense attention backends with which SGLang 0.5.23 verifies EAGLE draft trees at a page size
#: above 1 (its ``_PAGE_TREE_SPEC_BACKENDS``; it refuses the others, trtllm_mha refuses trees
#: outright). M3 runs page size 128; its sparse layers verify trees on every profile.
TREE_VERIFY_BACKENDS = ("fa3", "triton", "flashinfer")

#: Verify tokens per request a draft tree may have: the MSA plans' per-request ancestor bitmask
#: (``msa_kernels.plan.DraftTree.MAX_TOKENS``; the plugin refuses more at start-up).
MAX_DRAFT_TREE_TOKENS = 64


def draft_tree_candidates(speculative) -> int:
    """Draft tokens an EAGLE tree scores per verify step in SGLang 0.5.23
    (``eagle_utils.organize_draft_results``): topk from the first step, topk x topk from each
    later one; it keeps the best numDraftTokens - 1 of them."""
    topk = speculative.eagle_topk
    return topk + (speculative.num_steps - 1) * topk * topk


def check_speculative(recipe: Recipe, profile: HardwareProfile) -> Iterator[Finding]:
    speculative = recipe.spec.speculative
    if speculative is None:
        return
    algorithm = speculative.algorithm
    draft = speculative.draft_model
    if algorithm in ("EAGLE", "EAGLE3") and draft is None:
        yield _error(
            "spec.speculative.draftModel",
            f"{algorithm} needs draft weights; set draftModel.path (M3's published EAGLE3 "
            f"draft is Inferact/MiniMax-M3-EAGLE3)",
            "speculative.draft-required")
    if algorithm == "NGRAM" and draft is not None:
        yield _error("spec.speculative.draftModel",
                     "NGRAM drafts from the prompt and uses no draft model; remove draftModel",
                     "speculative.ngram-no-draft")
    if algorithm == "NGRAM":
        yield _error("spec.speculative.algorithm",
                     "NGRAM verifies irregular draft trees (SGLang reports tree_topk -1), which M3's sparse "
                     "attention does not verify (it verifies EAGLE chains and EAGLE trees); use EAGLE3",
                     "speculative.ngram-tree")
    if draft is not None and algorithm == "EAGLE" and "eagle3" in draft.path.lower():
        yield _error("spec.speculative.algorithm",
                     f"{draft.path} is an EAGLE3 draft; set algorithm: EAGLE3",
                     "speculative.algorithm-draft")
    dense_backend = attention_backend_for(profile, recipe.spec.kv_cache.dtype)
    if speculative.eagle_topk != 1 and profile.is_gpu and dense_backend not in TREE_VERIFY_BACKENDS:
        yield _error(
            "spec.speculative.eagleTopk",
            f"on {profile.name} M3's dense layers run the {dense_backend} attention backend, with which "
            f"SGLang does not verify draft trees at page size 128 (only {', '.join(TREE_VERIFY_BACKENDS)}); "
            "set eagleTopk: 1 (a chain)",
            "speculative.tree-attention-backend")
    elif speculative.eagle_topk > 1 and speculative.num_draft_tokens < speculative.num_steps + 1:
        yield _error(
            "spec.speculative.numDraftTokens",
            f"a draft tree of {speculative.num_steps} steps verifies at least one token per step plus the "
            f"root, {speculative.num_steps + 1} tokens, and SGLang fails at its first decode with fewer (the "
            f"server refuses it); set numDraftTokens to at least {speculative.num_steps + 1}, or lower numSteps",
            "speculative.tree-too-short")
    elif speculative.eagle_topk > 1 and speculative.num_draft_tokens > draft_tree_candidates(speculative) + 1:
        yield _error(
            "spec.speculative.numDraftTokens",
            f"a draft tree of {speculative.num_steps} steps with eagleTopk {speculative.eagle_topk} offers "
            f"{draft_tree_candidates(speculative)} candidate tokens (topk + (numSteps - 1) x topk^2), and SGLang "
            f"verifies numDraftTokens - 1 of them (it fails at its first decode when there are fewer); set "
            f"numDraftTokens to at most {draft_tree_candidates(speculative) + 1}, or raise numSteps or eagleTopk",
            "speculative.tree-candidates")
    elif speculative.eagle_topk > 1 and speculative.num_draft_tokens > MAX_DRAFT_TREE_TOKENS:
        yield _error(
            "spec.speculative.numDraftTokens",
            f"M3's sparse attention verifies draft trees of at most {MAX_DRAFT_TREE_TOKENS} tokens per "
            f"request (the MSA plans' ancestor mask; the server refuses more); set numDraftTokens to at "
            f"most {MAX_DRAFT_TREE_TOKENS}",
            "speculative.tree-tokens")
    elif speculative.eagle_topk == 1 and speculative.num_draft_tokens != speculative.num_steps + 1:
        yield _error(
            "spec.speculative.numDraftTokens",
            f"a chain of {speculative.num_steps} steps verifies {speculative.num_steps + 1} "
            f"tokens; set numDraftTokens: {speculative.num_steps + 1}",
            "speculative.draft-tokens")
    if speculative.adaptive:
        yield from _check_adaptive(recipe)
    yield from _check_pipeline_speculative(recipe)
    if profile.is_gpu and profile.vendor != "nvidia":
        yield _warning(
            "spec.speculative",
            f"M3's EAGLE verification runs on the project's MSA Triton kernels (the dense layers' "
            f"too), served token-exact on NVIDIA GPUs (H100 and H200, in the project's GPU harness) "
            f"but never on ROCm; verify it on {profile.name} before relying on it",
            "speculative.unverified-gpu")


#: Chain lengths SGLang 0.5.23's adaptive speculation starts from: the draft steps of its default
#: candidates (``DEFAULT_ADAPTIVE_CONFIG``) that numSteps may take (0, no draft, is below its minimum).
#: It refuses any other --speculative-num-steps at start-up.
ADAPTIVE_START_STEPS = (1, 3, 5, 7)


def _check_adaptive(recipe: Recipe) -> Iterator[Finding]:
    """Where SGLang would drop adaptive with only a log warning, or fail with it at start-up."""
    spec = recipe.spec
    speculative = spec.speculative
    if speculative.algorithm not in ("EAGLE", "EAGLE3"):
        yield _error("spec.speculative.adaptive",
                     f"SGLang adapts EAGLE and EAGLE3 chains only; with {speculative.algorithm} it ignores "
                     "adaptive (a warning in its log); remove adaptive",
                     "speculative.adaptive-algorithm")
    if speculative.eagle_topk > 1:
        yield _error("spec.speculative.adaptive",
                     f"SGLang adapts chains only; with eagleTopk {speculative.eagle_topk} it ignores adaptive (a "
                     "warning in its log) and serves the fixed tree; set eagleTopk: 1 or remove adaptive",
                     "speculative.adaptive-tree")
    if speculative.num_steps not in ADAPTIVE_START_STEPS:
        yield _error("spec.speculative.numSteps",
                     f"adaptive starts from one of the chain lengths it switches between, "
                     f"{', '.join(map(str, ADAPTIVE_START_STEPS))} (where it adapts, SGLang refuses "
                     f"--speculative-num-steps {speculative.num_steps} at start-up); set numSteps: 3 (and "
                     "numDraftTokens: 4)",
                     "speculative.adaptive-steps")
    if spec.parallelism.attention_dp > 1:
        yield _error("spec.speculative.adaptive",
                     "SGLang ignores adaptive under attention data parallelism (its chain length would differ "
                     "between DP ranks; a warning in its log); remove adaptive or set attentionDp: 1",
                     "speculative.adaptive-attention-dp")
    for index, flag in _extra_flags(spec.serving.extra_args):
        spelled = _flags_spelled(flag, ADAPTIVE_DROPPED_BY)
        if len(spelled) == 1:  # an ambiguous abbreviation never reaches adaptive: SGLang refuses it
            yield _error(f"spec.serving.extraArgs[{index}]",
                         f"{spelled[0]}: SGLang drops adaptive under it ({ADAPTIVE_DROPPED_BY[spelled[0]]}; only a "
                         "warning in its log) and serves the fixed chain; remove one of the two",
                         "speculative.adaptive-extra-args")


#: Server flags (reachable from a recipe only through ``extraArgs``) under which SGLang 0.5.23
#: turns ``--speculative-adaptive`` off with a log warning (``adaptive_unsupported_reason``).
ADAPTIVE_DROPPED_BY = {
    "--enable-multi-layer-eagle": "its multi-layer EAGLE worker does not adapt",
    "--enable-two-batch-overlap": "switching chains would drop the two-batch-overlap attention wrapper",
    "--enable-pdmux": "switching chains does not update the prefill/decode multiplexer's attention backends",
}


def _check_pipeline_speculative(recipe: Recipe) -> Iterator[Finding]:
    """The plugin's M3 serves drafts with one pipeline stage only: a draft reads the target's
    embedding (first stage), its head (last stage) and, for EAGLE3, layer outputs of every stage,
    and the model refuses a draft under ``--pp-size`` > 1 at start-up."""
    pp, algorithm = recipe.spec.parallelism.pp, recipe.spec.speculative.algorithm
    if pp > 1:
        yield _error(
            "spec.speculative.algorithm",
            f"pp {pp} with {algorithm}: sglang-m3's M3 serves speculative decoding with pp 1 only (a draft "
            f"reads the target's embedding on the first pipeline stage and its head on the last; the server "
            f"refuses the pair at start-up); remove speculative or set pp: 1",
            "speculative.pipeline")


# --- serving, parsers, offload ----------------------------------------------------------------

def check_extra_args(recipe: Recipe, profile: HardwareProfile) -> Iterator[Finding]:
    extra_args = recipe.spec.serving.extra_args
    yield from _check_extra_args_parse(extra_args)
    for index, flag in _extra_flags(extra_args):
        field = f"spec.serving.extraArgs[{index}]"
        mode = _option_value(extra_args, index) if _flags_spelled(flag, {DISAGGREGATION_FLAG: ""}) else None
        if mode in ("prefill", "decode"):
            yield _error(field, f"{DISAGGREGATION_FLAG} {mode}: the server refuses "
                                f"prefill/decode disaggregation for M3, since SGLang's KV transfer moves K and V "
                                f"but not the index keys its sparse attention selects blocks with; remove it",
                         "serving.disaggregation-unsupported")
            continue
        if flag == "--config":
            yield _error(field, "--config would override typed fields from another file; "
                                "put the settings in the recipe instead",
                         "serving.extra-args-config")
            continue
        typed = _flags_spelled(flag, TYPED_FLAGS)
        owners = sorted({TYPED_FLAGS[full] for full in typed})
        if len(owners) == 1:
            yield _error(
                field,
                f"{flag} duplicates the typed field {owners[0]} (SGLang {', '.join(typed)}); set {owners[0]} "
                f"instead and remove it from extraArgs",
                "serving.extra-args-duplicate")
        elif owners:
            yield _error(
                field,
                f"{flag} abbreviates {len(typed)} SGLang options ({', '.join(typed)}), which SGLang refuses "
                f"at start-up as ambiguous, and each belongs to a typed field; set {' or '.join(owners)} "
                f"instead and remove it from extraArgs",
                "serving.extra-args-ambiguous")


def _check_extra_args_parse(extra_args: list[str]) -> Iterator[Finding]:
    """What SGLang's argument parser refuses at start-up: an option it does not have, an
    abbreviation of several, a switch given a value, an option without its value, a word no
    option takes. Options that spell a typed field's flag are the typed check's to report."""
    takes = None  # arity of the option whose values may follow; None: no value may follow
    for index, token in enumerate(extra_args):
        field = f"spec.serving.extraArgs[{index}]"
        if not is_option_token(token):
            if takes in ("one", "optional"):
                takes = None
            elif takes != "many":
                yield _error(field, f"{token!r} is not an option and no option before it takes a value, so "
                                    f"SGLang refuses it as an unrecognized argument; remove it or put it "
                                    f"after the option it belongs to",
                             "sglang.stray-argument")
            continue
        resolved = resolve(token)
        takes = "many"  # after an option that is refused, the tokens that follow it are not judged
        if resolved.flag == "--config" or _flags_spelled(resolved.flag, TYPED_FLAGS):
            continue  # refused by check_extra_args, naming the typed field
        if not resolved.matches:
            yield _error(field, f"{resolved.flag} is not a server option of SGLang {SGLANG_OPTIONS_VERSION} "
                                f"(`python -m sglang.launch_server --help` lists them); the server refuses "
                                f"it at start-up",
                         "sglang.unknown-option")
            continue
        if len(resolved.matches) > 1:
            shown = ", ".join(resolved.matches[:4]) + (", ..." if len(resolved.matches) > 4 else "")
            yield _error(field, f"{resolved.flag} abbreviates {len(resolved.matches)} SGLang options ({shown}), "
                                f"which SGLang refuses as ambiguous at start-up; spell the option out",
                         "sglang.ambiguous-option")
            continue
        option = resolved.matches[0]
        arity = SGLANG_OPTIONS[option]
        following = extra_args[index + 1] if index + 1 < len(extra_args) else None
        if arity == "none" and resolved.inline_value:
            yield _error(field, f"{option} is a switch and takes no value; write it without "
                                f"'={token.partition('=')[2]}'",
                         "sglang.option-value")
        elif arity == "one" and not resolved.inline_value and (following is None or is_option_token(following)):
            yield _error(field, f"{option} needs a value, and none follows it; SGLang refuses it at start-up",
                         "sglang.option-value")
        elif arity == "none" and following is not None and not is_option_token(following):
            yield _error(f"spec.serving.extraArgs[{index + 1}]",
                         f"{option} is a switch and takes no value, so SGLang refuses {following!r} after it "
                         f"as an unrecognized argument; remove {following!r}",
                         "sglang.option-value")
            continue  # reported here, not again as a stray word
        else:
            takes = None if resolved.inline_value or arity == "none" else arity


#: SGLang's prefill/decode disaggregation switch, which the plugin refuses for M3 (``hooks.refuse_disaggregation``).
DISAGGREGATION_FLAG = "--disaggregation-mode"


def _option_value(extra_args: list[str], index: int) -> str | None:
    """The value of the option at ``index``: after its ``=``, else the next argument."""
    _, equals, value = extra_args[index].partition("=")
    if equals:
        return value
    return extra_args[index + 1] if index + 1 < len(extra_args) else None


def _extra_flags(extra_args: list[str]) -> Iterator[tuple[int, str]]:
    """``(index, flag)`` of each option in ``extraArgs``, its ``=value`` cut (values are skipped)."""
    for index, argument in enumerate(extra_args):
        if argument.startswith("--"):
            yield index, argument.split("=", 1)[0]


def _flags_spelled(flag: str, flags: dict[str, str]) -> list[str]:
    """The options of ``flags`` that ``flag`` spells: itself, or every option it abbreviates the
    way argparse expands abbreviations (SGLang's parser allows them; more than one is ambiguous,
    which argparse refuses)."""
    if flag in flags:
        return [flag]
    if len(flag) <= 3:
        return []
    return [full for full in flags if full.startswith(flag)]


def check_max_total_tokens(recipe: Recipe, profile: HardwareProfile) -> Iterator[Finding]:
    spec = recipe.spec
    cap = spec.serving.max_total_tokens
    if cap is not None and cap < spec.context_length:
        yield _error(
            "spec.serving.maxTotalTokens",
            f"a KV pool capped at {cap:,} tokens cannot hold one request of contextLength "
            f"{spec.context_length:,}; raise maxTotalTokens to at least {spec.context_length} or "
            f"lower contextLength",
            "serving.max-total-tokens")


def check_mem_fraction(recipe: Recipe, profile: HardwareProfile) -> Iterator[Finding]:
    fraction = recipe.spec.serving.mem_fraction_static
    if profile.is_gpu and fraction > 0.95:
        yield _warning(
            "spec.serving.memFractionStatic",
            f"{fraction} leaves under 5% of GPU memory for activations and CUDA graphs; "
            f"0.85-0.92 is usual",
            "serving.mem-fraction")


def check_amd_watchdog(recipe: Recipe, profile: HardwareProfile) -> Iterator[Finding]:
    spec = recipe.spec
    if profile.architecture != "cdna3" or spec.model.variant != "mxfp8":
        return
    timeout = spec.serving.watchdog_timeout
    if timeout is None or timeout < 1800:
        yield _warning(
            "spec.serving.watchdogTimeout",
            f"on {profile.name} MXFP8 weights are converted to block FP8 while loading, which "
            f"outlasts SGLang's default watchdog; set watchdogTimeout: 3600",
            "amd.mxfp8-watchdog")


#: ``--reasoning-parser`` / ``--tool-call-parser`` names SGLang 0.5.23 accepts (its argparse
#: choices, with the plugin's minimax-m3 registered; a test compares them with the installed SGLang).
SGLANG_REASONING_PARSERS = frozenset((
    "auto", "apertus2509", "beam", "cohere_command4", "deepseek-r1", "deepseek-v3", "deepseek-v4",
    "deepseek-v41", "dots", "gemma4", "gigachat35", "glm45", "gpt-oss", "granite_thinking_parser", "hunyuan",
    "inkling", "interns1", "iquest_q1", "k2_horizon", "kimi", "kimi_k2", "kimi_k3", "ling3", "mimo", "minimax",
    "minimax-append-think", "minimax-m3", "mistral", "muse", "nanbeige", "nemotron_3", "poolside_v1", "qwen3",
    "qwen3-thinking", "response_template", "step3", "step3p5",
))
SGLANG_TOOL_CALL_PARSERS = frozenset((
    "auto", "apertus2509", "beam", "cohere_command4", "deepseekv3", "deepseekv31", "deepseekv32", "deepseekv4",
    "deepseekv41", "dots", "gemma4", "gigachat3", "gigachat35", "glm", "glm45", "glm47", "gpt-oss", "hermes",
    "hunyuan", "inkling", "interns1", "iquest_q1", "k2_horizon", "kimi_k2", "kimi_k3", "lfm2", "ling3", "llama3",
    "mimo", "minicpm5", "minimax-m2", "minimax-m3", "mistral", "muse", "nanbeige", "poolside_v1", "pythonic", "qwen",
    "qwen25", "qwen3_coder", "response_template", "spark25", "step3", "step3p5", "trinity",
))
#: the parser that reads M3's own output format (``<mm:think>`` reasoning, namespaced tool calls)
M3_PARSER = "minimax-m3"
#: M3's parser under every name the plugin registers it by (``parsers.registration``)
M3_PARSER_NAMES = (M3_PARSER, *PARSER_ALIASES)


def check_parser_names(recipe: Recipe, profile: HardwareProfile) -> Iterator[Finding]:
    parsers = recipe.spec.parsers
    for field, name, known in (("reasoning", parsers.reasoning, SGLANG_REASONING_PARSERS),
                               ("toolCall", parsers.tool_call, SGLANG_TOOL_CALL_PARSERS)):
        if name == NO_PARSER or name in M3_PARSER_NAMES:
            continue
        if name not in known:
            yield _error(f"spec.parsers.{field}",
                         f"{name!r} is not a parser SGLang {PINNED_SGLANG_VERSION} knows (it refuses the "
                         f"flag at start-up); M3's is {M3_PARSER}", "parsers.unknown")
        else:
            yield _warning(f"spec.parsers.{field}",
                           f"{name} parses another model's output format, not M3's; set {field}: "
                           f"{M3_PARSER} (or {NO_PARSER} to leave the text as it is)", "parsers.other-model")


def check_parsers(recipe: Recipe, profile: HardwareProfile) -> Iterator[Finding]:
    parsers = recipe.spec.parsers
    if parsers.reasoning == NO_PARSER and parsers.default_thinking_mode != "disabled":
        yield _warning(
            "spec.parsers.reasoning",
            f"with thinking mode {parsers.default_thinking_mode} and no reasoning parser, "
            f"<mm:think> blocks stay in the reply content; set reasoning: minimax-m3",
            "parsers.reasoning")


def check_multimodal(recipe: Recipe, profile: HardwareProfile) -> Iterator[Finding]:
    multimodal = recipe.spec.multimodal
    if multimodal.enabled:
        return
    for field, value in (("limitPerRequest", multimodal.limit_per_request), ("media", multimodal.media)):
        if value is not None:
            yield _error(f"spec.multimodal.{field}",
                         "media limits have no effect with multimodal disabled; remove them or set "
                         "enabled: true",
                         "multimodal.limits-unused")


def check_host_offload(recipe: Recipe, profile: HardwareProfile) -> Iterator[Finding]:
    offload = recipe.spec.host_offload
    if offload is None:
        return
    if offload.mode == "hisparse":
        # SGLang's HiSparse keys on its own M3 wiring (is_minimax_sparse), which the plugin turns
        # off to install the index-key pool and MSA backend: SGLang then refuses --enable-hisparse
        # at start-up on every platform (its CUDA-only kernels aside).
        yield _error("spec.hostOffload.mode",
                     "hisparse is SGLang's own M3 offload, which this plugin's MSA backend and "
                     "index-key pool replace (the server refuses --enable-hisparse); use mode: "
                     "hierarchical-cache", "offload.hisparse")
    if offload.mode in ("hierarchical-cache", "sparse-offload"):
        if offload.size_gb_per_rank is None:
            yield _error("spec.hostOffload.sizeGbPerRank",
                         f"{offload.mode} needs the host memory per rank; set sizeGbPerRank",
                         "offload.size")
        if offload.host_to_device_ratio is not None:
            yield _error("spec.hostOffload.hostToDeviceRatio",
                         "hostToDeviceRatio sizes hisparse only; remove it",
                         "offload.mode-field")
    elif offload.size_gb_per_rank is not None:
        yield _error("spec.hostOffload.sizeGbPerRank",
                     "hisparse is sized by hostToDeviceRatio; remove sizeGbPerRank",
                     "offload.mode-field")
    if offload.mode == "hierarchical-cache":
        yield from _check_radix_cache_kept(recipe)
    if offload.mode == "sparse-offload":
        yield from _check_sparse_offload(recipe, profile)
    elif offload.cache_blocks is not None:
        yield _error("spec.hostOffload.cacheBlocks", "cacheBlocks sizes sparse-offload only; remove it",
                     "offload.mode-field")


#: The SGLang switch that turns the radix cache off, which the hierarchical cache extends.
RADIX_OFF_FLAG = "--disable-radix-cache"


def _check_radix_cache_kept(recipe: Recipe) -> Iterator[Finding]:
    """SGLang refuses --enable-hierarchical-cache beside --disable-radix-cache at start-up: the
    host tier keeps the prefixes the radix tree evicts."""
    for index, flag in _extra_flags(recipe.spec.serving.extra_args):
        if resolve(flag).matches == (RADIX_OFF_FLAG,):
            yield _error(f"spec.serving.extraArgs[{index}]",
                         f"{RADIX_OFF_FLAG}: hostOffload.mode hierarchical-cache keeps the prefixes the radix "
                         f"cache evicts in host memory, and SGLang refuses the two together at start-up; remove "
                         f"{flag} or the hostOffload section",
                         "offload.hierarchical-cache-radix")


def _check_sparse_offload(recipe: Recipe, profile: HardwareProfile) -> Iterator[Finding]:
    if recipe.spec.host_offload.cache_blocks is None:
        yield _error("spec.hostOffload.cacheBlocks",
                     "sparse-offload needs the device block cache size; set cacheBlocks (blocks per "
                     "sparse layer, at least KV heads per rank x top-k blocks x query tokens per step)",
                     "offload.cache-blocks")
    if profile.vendor == "amd":
        yield _error("spec.hostOffload.mode",
                     "sparse-offload is served on the CPU platform and on NVIDIA GPUs (the MSA Triton path "
                     "reading a page-locked host store is not verified on ROCm); the server refuses it there",
                     "offload.sparse-gpu")
    if recipe.spec.parallelism.pp > 1:
        yield _error("spec.parallelism.pp", "sparse-offload runs with pp 1 only (the server refuses --pp-size > 1)",
                     "offload.sparse-pp")
    speculative = recipe.spec.speculative
    if speculative is not None and speculative.eagle_topk > 1:
        yield _error("spec.speculative.eagleTopk",
                     "sparse-offload serves speculative chains only (a draft tree's attention reads each draft from "
                     "its pool slot, which lives in the host store; the server refuses trees); set eagleTopk: 1",
                     "offload.sparse-tree")
    # M3's geometry counts the selection; the cpu profile serves the tiny model, whose heads and
    # top-k are its own (the server checks that one at start-up)
    needed = sparse_offload_blocks_needed(recipe)
    blocks = recipe.spec.host_offload.cache_blocks
    if profile.is_gpu and blocks is not None and blocks < needed:
        yield _error("spec.hostOffload.cacheBlocks",
                     f"cacheBlocks {blocks} is smaller than one request's selection: query tokens per step"
                     f"{' (the longest adaptive chain, ' + str(max(ADAPTIVE_START_STEPS)) + ' drafts + 1)' if speculative is not None and speculative.adaptive else ''} x KV "
                     f"heads per rank x top-{M3.sparse_topk_blocks} = {needed} blocks (the server refuses it); "
                     f"set cacheBlocks to at least {needed}",
                     "offload.cache-blocks-min")


def sparse_offload_blocks_needed(recipe: Recipe) -> int:
    """Blocks one request can select in one step on one rank, as the server counts them: every
    query token's top-k for each KV head the rank holds (a verify step has numDraftTokens; under
    adaptive, the longest chain SGLang may switch to: the server sizes its rounds for that one)."""
    parallel, speculative = recipe.spec.parallelism, recipe.spec.speculative
    attention_tp = max(1, parallel.tp // parallel.attention_dp)  # attentionDp > tp: refused by check_heads
    kv_heads = max(1, M3.num_kv_heads // attention_tp)
    query_tokens = speculative.num_draft_tokens if speculative is not None else 1
    if speculative is not None and speculative.adaptive:
        query_tokens = max(query_tokens, max(ADAPTIVE_START_STEPS) + 1)
    return sparse_offload_selection_blocks(query_tokens, kv_heads, M3.sparse_topk_blocks)


def check_provenance(recipe: Recipe, profile: HardwareProfile) -> Iterator[Finding]:
    verified = recipe.spec.provenance.verified
    if verified is not None and verified.sglang_version != PINNED_SGLANG_VERSION:
        yield _warning(
            "spec.provenance.verified.sglangVersion",
            f"verified with SGLang {verified.sglang_version}, but this project pins "
            f"{PINNED_SGLANG_VERSION}; re-verify and update the date",
            "provenance.sglang-version")


def check_memory_fit(recipe: Recipe, profile: HardwareProfile) -> Iterator[Finding]:
    # more stages than layers is check_pipeline's error; no stage layout to size then
    if (fit_applies(recipe) and recipe.spec.model.variant in profile.variants
            and recipe.spec.parallelism.pp <= M3.num_layers):
        yield from estimate_fit(recipe).findings()


RULES: tuple[Rule, ...] = (
    check_variant,
    check_gpus_per_node,
    check_cpu_profile,
    check_model_path_variant,
    check_served_model_name,
    check_gpu_count,
    check_node_layout,
    check_data_parallel,
    check_heads,
    check_expert_parallel,
    check_mxfp8_scale_groups,
    check_pipeline,
    check_scale_up_domain,
    check_page_size,
    check_kv_dtype,
    check_typed_env,
    check_platform_env,
    check_plugin_switches,
    check_env_names,
    check_index_key_dtype,
    check_context_length,
    check_speculative,
    check_extra_args,
    check_max_total_tokens,
    check_mem_fraction,
    check_amd_watchdog,
    check_parser_names,
    check_parsers,
    check_multimodal,
    check_host_offload,
    check_provenance,
    check_memory_fit,
)


def validate_recipe(recipe: Recipe) -> list[Finding]:
    """Every finding of every rule, errors and warnings, in rule order."""
    profile = get_profile(recipe.spec.hardware.profile)
    return [finding for rule in RULES for finding in rule(recipe, profile)]
