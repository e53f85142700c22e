"""Recipe -> the command line and environment of ``python -m sglang.launch_server``.

One pure function, shared by ``sglang-m3 recipe render``, ``sglang-m3 serve`` and the
operator, so a recipe means the same launch everywhere. It does not judge the recipe (that is
``validate_recipe``); it renders any recipe that loaded, so a rendered command can be shown
next to the findings that explain why it would fail.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from .catalog import HardwareProfile, get_profile
from .schema import NO_PARSER, Recipe

#: Address of the group leader inside a LeaderWorkerSet; Kubernetes expands ``$(VAR)`` in
#: container arguments, so the rendered multi-node command works unchanged in a pod.
LEADER_DIST_INIT_ADDR = "$(LWS_LEADER_ADDRESS):20000"

#: Environment variable by which SGLang selects its platform. The renderer owns it: it sets it
#: for the cpu profile and leaves it unset on GPU profiles, where SGLang detects the GPU's own.
PLATFORM_ENV = "SGLANG_PLATFORM"

#: ``SGLANG_PLATFORM`` value that selects the project's torch-native CPU platform.
CPU_PLATFORM_NAME = "sglang_m3_cpu"

#: Environment variable the plugin's KV pool reads for ``spec.kvCache.indexKeyDtype`` (SGLang's
#: server arguments cannot be extended by a plugin).
INDEX_KEY_DTYPE_ENV = "SGLANG_M3_INDEX_KEY_DTYPE"

#: Environment variables of ``hostOffload.mode: sparse-offload`` (read by ``sglang_m3.cache``):
#: block-cache entries per sparse layer, host-store budget per rank in GB.
SPARSE_OFFLOAD_BLOCKS_ENV = "SGLANG_M3_SPARSE_OFFLOAD_BLOCKS"
SPARSE_OFFLOAD_HOST_GB_ENV = "SGLANG_M3_SPARSE_OFFLOAD_HOST_GB"


def sparse_offload_selection_blocks(query_tokens: int, kv_heads: int, topk: int) -> int:
    """Distinct blocks one request can select in one sparse-offload step on one rank: every query
    token's top-k for each KV head the rank holds. The server sizes its fetch rounds by it
    (``sglang_m3.cache.offload_settings.OffloadShape``), and the recipe rules refuse a
    ``cacheBlocks`` below it."""
    return query_tokens * kv_heads * topk


#: Every environment variable the renderer owns, with the typed field that renders it. A
#: ``spec.env`` entry naming one would override that field where the rules and the memory fit do
#: not see it; the value names the field.
TYPED_ENV: dict[str, str] = {
    INDEX_KEY_DTYPE_ENV: "spec.kvCache.indexKeyDtype",
    SPARSE_OFFLOAD_BLOCKS_ENV: "spec.hostOffload.cacheBlocks",
    SPARSE_OFFLOAD_HOST_GB_ENV: "spec.hostOffload.sizeGbPerRank",
}

#: Every SGLang option the renderer owns, with the aliases SGLang registers for it. An extra
#: argument spelling any of these (or an abbreviation argparse would expand to one) duplicates
#: a typed field; the value names that field.
TYPED_FLAGS: dict[str, str] = {
    "--model-path": "spec.model.path",
    "--model": "spec.model.path",
    "--revision": "spec.model.revision",
    "--served-model-name": "spec.model.servedModelName",
    "--trust-remote-code": "spec.model.trustRemoteCode",
    "--quantization": "spec.model.variant",
    "--device": "spec.hardware.profile",
    "--attention-backend": "spec.hardware.profile",
    "--mm-attention-backend": "spec.hardware.profile",
    "--nnodes": "spec.hardware.nodes",
    "--node-rank": "spec.hardware.nodes",
    "--dist-init-addr": "spec.hardware.nodes",
    "--nccl-init-addr": "spec.hardware.nodes",
    "--tp-size": "spec.parallelism.tp",
    "--tensor-parallel-size": "spec.parallelism.tp",
    "--pp-size": "spec.parallelism.pp",
    "--pipeline-parallel-size": "spec.parallelism.pp",
    "--dp-size": "spec.parallelism.dp",
    "--data-parallel-size": "spec.parallelism.dp",
    "--ep-size": "spec.parallelism.ep",
    "--expert-parallel-size": "spec.parallelism.ep",
    "--ep": "spec.parallelism.ep",
    "--attn-dp-size": "spec.parallelism.attentionDp",
    "--attention-data-parallel-size": "spec.parallelism.attentionDp",
    "--enable-dp-attention": "spec.parallelism.attentionDp",
    "--context-length": "spec.contextLength",
    "--page-size": "spec.kvCache.pageSize",
    "--kv-cache-dtype": "spec.kvCache.dtype",
    "--speculative-algorithm": "spec.speculative.algorithm",
    "--speculative-draft-model-path": "spec.speculative.draftModel.path",
    "--speculative-draft-model": "spec.speculative.draftModel.path",
    "--speculative-draft-model-revision": "spec.speculative.draftModel.revision",
    "--speculative-num-steps": "spec.speculative.numSteps",
    "--speculative-eagle-topk": "spec.speculative.eagleTopk",
    "--speculative-num-draft-tokens": "spec.speculative.numDraftTokens",
    "--speculative-adaptive": "spec.speculative.adaptive",
    "--reasoning-parser": "spec.parsers.reasoning",
    "--tool-call-parser": "spec.parsers.toolCall",
    "--default-chat-template-kwargs": "spec.parsers.defaultThinkingMode",
    "--enable-multimodal": "spec.multimodal.enabled",
    "--language-model-only": "spec.multimodal.enabled",
    "--limit-mm-data-per-request": "spec.multimodal.limitPerRequest",
    "--mm-process-config": "spec.multimodal.media",
    "--enable-hierarchical-cache": "spec.hostOffload",
    "--enable-hicache": "spec.hostOffload",
    "--hicache-size": "spec.hostOffload.sizeGbPerRank",
    "--enable-hisparse": "spec.hostOffload.mode",
    "--hisparse-config": "spec.hostOffload.hostToDeviceRatio",
    "--hierarchical-sparse-attention-extra-config": "spec.hostOffload.hostToDeviceRatio",
    "--mem-fraction-static": "spec.serving.memFractionStatic",
    "--chunked-prefill-size": "spec.serving.chunkedPrefillSize",
    "--max-running-requests": "spec.serving.maxRunningRequests",
    "--max-total-tokens": "spec.serving.maxTotalTokens",
    "--watchdog-timeout": "spec.serving.watchdogTimeout",
    "--host": "spec.serving.host",
    "--port": "spec.serving.port",
}


@dataclass(frozen=True)
class LaunchSpec:
    """What to run: ``python -m sglang.launch_server *argv`` with ``env`` added."""

    argv: list[str]
    """Arguments after the module name."""
    env: dict[str, str] = field(default_factory=dict)
    """Environment variables to set on top of the inherited environment."""

    def command(self, python: str = "python") -> list[str]:
        return [python, "-m", "sglang.launch_server", *self.argv]


def attention_backend_for(profile: HardwareProfile, kv_dtype: str) -> str:
    """The dense-layer attention backend SGLang should use for M3 on this hardware.

    On Blackwell an fp8_e4m3 KV cache is served by trtllm_mha (fa4 has no fp8-KV M3 path)."""
    if profile.architecture == "blackwell" and kv_dtype == "fp8_e4m3":
        return "trtllm_mha"
    return profile.attention_backend


def render_launch(
    recipe: Recipe,
    *,
    node_rank: int | str = 0,
    dist_init_addr: str | None = None,
) -> LaunchSpec:
    """Render the SGLang launch for one node of ``recipe``.

    ``node_rank`` and ``dist_init_addr`` matter only for multi-node recipes; a string rank
    such as ``$(LWS_WORKER_INDEX)`` is left for Kubernetes to expand, and the address defaults
    to the LeaderWorkerSet leader."""
    spec = recipe.spec
    profile = get_profile(spec.hardware.profile)
    argv: list[str] = []

    def add(flag: str, value: object | None = None) -> None:
        if isinstance(value, str) and value.startswith("-"):
            # argparse reads a separate "-x" as an option and refuses the flag for want of its
            # value ("expected one argument"); joined by "=" it is the value whatever it holds
            argv.append(f"{flag}={value}")
            return
        argv.append(flag)
        if value is not None:
            argv.append(str(value))

    add("--model-path", spec.model.path)
    if spec.model.revision:
        add("--revision", spec.model.revision)
    if spec.model.served_model_name:
        add("--served-model-name", spec.model.served_model_name)
    if spec.model.trust_remote_code:
        add("--trust-remote-code")
    if spec.model.variant == "mxfp8":
        # SGLang detects MXFP8 from the checkpoint; the cookbook passes it explicitly so a
        # checkpoint mix-up fails at load instead of serving with the wrong kernels. Same on
        # Hopper: in SGLang 0.5.23 the flag only makes ModelConfig refuse a checkpoint whose
        # quantization_config is not mxfp8 (its M3 override sets mxfp8 from the checkpoint
        # anyway, so every other server argument resolves as without the flag), and the plugin's
        # loader hook (sglang_m3.quant.serving) gives M3 the project's own quantization config
        # (W8A16 linears, capability 90), so SGLang's MXFP8 layers and their SM100 capability
        # check are never reached; the plugin reads the MXFP8 tensors from the checkpoint itself.
        add("--quantization", "mxfp8")

    add("--device", profile.device)
    add("--attention-backend", attention_backend_for(profile, spec.kv_cache.dtype))
    _add_parallelism(add, recipe, node_rank, dist_init_addr)

    add("--context-length", spec.context_length)
    add("--page-size", spec.kv_cache.page_size)
    if spec.kv_cache.dtype != "auto":
        add("--kv-cache-dtype", spec.kv_cache.dtype)

    _add_speculative(add, recipe)
    _add_parsers(add, recipe)
    _add_multimodal(add, recipe, profile)
    _add_host_offload(add, recipe)
    _add_serving(add, recipe)
    argv.extend(spec.serving.extra_args)

    env = {PLATFORM_ENV: CPU_PLATFORM_NAME} if not profile.is_gpu else {}
    if spec.kv_cache.index_key_dtype != "bf16":
        env[INDEX_KEY_DTYPE_ENV] = spec.kv_cache.index_key_dtype
    env.update(_sparse_offload_env(recipe))
    env.update(spec.env)
    return LaunchSpec(argv=argv, env=env)


def _add_parallelism(add, recipe: Recipe, node_rank, dist_init_addr) -> None:
    parallel = recipe.spec.parallelism
    add("--tp-size", parallel.tp)
    if parallel.pp > 1:
        add("--pp-size", parallel.pp)
    if parallel.dp > 1:
        add("--dp-size", parallel.dp)
    if parallel.ep > 1:
        add("--ep-size", parallel.ep)
    if parallel.attention_dp > 1:
        add("--attn-dp-size", parallel.attention_dp)
    nodes = recipe.spec.hardware.nodes
    if nodes > 1:
        add("--nnodes", nodes)
        add("--node-rank", node_rank)
        add("--dist-init-addr", dist_init_addr or LEADER_DIST_INIT_ADDR)


def _add_speculative(add, recipe: Recipe) -> None:
    speculative = recipe.spec.speculative
    if speculative is None:
        return
    add("--speculative-algorithm", speculative.algorithm)
    if speculative.draft_model is not None:
        add("--speculative-draft-model-path", speculative.draft_model.path)
        if speculative.draft_model.revision:
            add("--speculative-draft-model-revision", speculative.draft_model.revision)
    add("--speculative-num-steps", speculative.num_steps)
    add("--speculative-eagle-topk", speculative.eagle_topk)
    add("--speculative-num-draft-tokens", speculative.num_draft_tokens)
    if speculative.adaptive:
        add("--speculative-adaptive")


def _add_parsers(add, recipe: Recipe) -> None:
    parsers = recipe.spec.parsers
    if parsers.reasoning != NO_PARSER:
        add("--reasoning-parser", parsers.reasoning)
    if parsers.tool_call != NO_PARSER:
        add("--tool-call-parser", parsers.tool_call)
    add("--default-chat-template-kwargs",
        json.dumps({"thinking_mode": parsers.default_thinking_mode}))


def _add_multimodal(add, recipe: Recipe, profile: HardwareProfile) -> None:
    multimodal = recipe.spec.multimodal
    if not multimodal.enabled:
        add("--language-model-only")
        return
    add("--enable-multimodal")
    if profile.mm_attention_backend:
        add("--mm-attention-backend", profile.mm_attention_backend)
    if multimodal.limit_per_request is not None:
        add("--limit-mm-data-per-request",
            json.dumps(multimodal.limit_per_request.model_dump()))
    limits = media_process_limits(multimodal)
    if limits:
        add("--mm-process-config", json.dumps({"limits": limits}, sort_keys=True))


def media_process_limits(multimodal) -> dict[str, float | int]:
    """The M3 media processor's limit names (``sglang_m3.multimodal.limits.MediaLimits``)."""
    limits: dict[str, float | int] = {}
    if multimodal.limit_per_request is not None:
        limits["max_images"] = multimodal.limit_per_request.image
        limits["max_videos"] = multimodal.limit_per_request.video
    media = multimodal.media
    if media is not None:
        mib = 1024 * 1024
        for key, value in (
            ("max_image_bytes", media.max_image_megabytes and media.max_image_megabytes * mib),
            ("max_video_bytes", media.max_video_megabytes and media.max_video_megabytes * mib),
            ("max_image_pixels", media.max_image_pixels),
            ("max_video_seconds", media.max_video_seconds),
            ("max_video_frames", media.max_video_frames),
            ("video_fps", media.video_fps),
        ):
            if value is not None:
                limits[key] = value
    # A count of 0 is SGLang's --limit-mm-data-per-request business; the processor's limits are positive.
    return {k: v for k, v in limits.items() if v}


def _add_host_offload(add, recipe: Recipe) -> None:
    offload = recipe.spec.host_offload
    if offload is None:
        return
    if offload.mode == "sparse-offload":
        return  # environment only: _sparse_offload_env
    if offload.mode == "hisparse":
        add("--enable-hisparse")
        add("--disable-radix-cache")
        if offload.host_to_device_ratio is not None:
            add("--hisparse-config",
                json.dumps({"host_to_device_ratio": offload.host_to_device_ratio}))
        return
    add("--enable-hierarchical-cache")
    if offload.size_gb_per_rank is not None:
        add("--hicache-size", offload.size_gb_per_rank)


def _sparse_offload_env(recipe: Recipe) -> dict[str, str]:
    offload = recipe.spec.host_offload
    if offload is None or offload.mode != "sparse-offload":
        return {}
    env = {}
    if offload.cache_blocks is not None:
        env[SPARSE_OFFLOAD_BLOCKS_ENV] = str(offload.cache_blocks)
    if offload.size_gb_per_rank is not None:
        env[SPARSE_OFFLOAD_HOST_GB_ENV] = str(offload.size_gb_per_rank)
    return env


def _add_serving(add, recipe: Recipe) -> None:
    serving = recipe.spec.serving
    add("--mem-fraction-static", serving.mem_fraction_static)
    add("--chunked-prefill-size", serving.chunked_prefill_size)
    add("--max-running-requests", serving.max_running_requests)
    if serving.max_total_tokens is not None:
        add("--max-total-tokens", serving.max_total_tokens)
    if serving.watchdog_timeout is not None:
        add("--watchdog-timeout", serving.watchdog_timeout)
    add("--host", serving.host)
    add("--port", serving.port)
