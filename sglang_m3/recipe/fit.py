"""Memory fit: do the weights, the KV cache and the runtime reserve fit the GPUs?

Per GPU rank of one replica:

* weights: the bytes ``sglang-m3 inspect`` measured per sharding group (``model_geometry``),
  each split by its rule: q/o projections over attention-TP = tp / attentionDp (attention DP
  replicates them per group), K/V projections over min(attention-TP, 4 KV heads), dense MLPs,
  shared experts, embedding and lm_head over tp, routed experts over tp (expert parallelism
  inside the TP group leaves 1/tp of them per rank too), the rest (norms, index projections,
  router, vision tower) whole on every rank; pipeline stages hold their layers, the first also
  the embedding and vision tower, the last the final norm and lm_head; the fullest stage counts.
  MXFP8 uses the same groups in inspect's MXFP8 layout: every quantized linear as the checkpoint
  stores it (1 byte per element plus a scale byte per 32, the rest as built), which Blackwell
  and Hopper alike keep in GPU memory;
* KV bytes per token = worst pipeline stage's layers x (2 x KV heads per rank x 128 x KV dtype)
  + its sparse layers x 128 x 2 bytes for the bf16 index key. KV heads per rank = 4 /
  attention-TP, at least 1: beyond attention-TP 4 each KV head (and the single index-key head
  always) is replicated, so KV per token stops shrinking. This is the cell size of the pool the
  plugin builds (SGLang 0.5.23's MHA cell, ``pool_configurator``, plus the index keys its hook
  adds, ``sglang_m3.cache.index_kv_pool.index_bytes_per_token``): the index key stays in the
  model dtype under an fp8 KV cache on every GPU (SGLang's own M3 pool, which stores it in fp8
  with fp8_e4m3 on Hopper and Blackwell, is not the one that serves). ``kvCache.indexKeyDtype:
  fp8_e4m3`` (the plugin's fp8 index keys) counts 128 fp8 bytes + a 4-byte scale per sparse
  layer instead;
* the host tier (``hostOffload.mode: hierarchical-cache``) holds sizeGbPerRank GB per rank
  (--hicache-size) of evicted radix prefixes, each token with its K/V *and* its index keys (the
  project's host pool mirrors both, so a prefix comes back whole): host tokens = that budget /
  the same bytes per token, page-rounded the way SGLang sizes its host pool. It extends what
  prefixes stay cached, not what one request may hold: every running token is on the GPU;
* sparse offload (``hostOffload.mode: sparse-offload``) moves the sparse layers' main K/V to a
  host store of sizeGbPerRank GB per rank: a token then costs the GPU only its index keys and the
  dense layers' K/V, the host 2 x KV heads per rank x 128 x KV dtype per sparse layer; the pool
  holds as many tokens as the tighter tier allows (the plugin caps SGLang's pool the same way,
  ``sglang_m3.cache.offload_budget``), and the per-layer block caches (cacheBlocks blocks of
  pageSize tokens of every sparse layer, plus one scratch block) come off the GPU's KV budget first;
* the static budget is GPU memory x memFractionStatic; the KV pool is what the weights leave
  of it; the rest of the GPU must hold the runtime reserve (activations of one prefill chunk,
  logits, CUDA graphs), which is a stated heuristic, not a measurement.

Speculative drafts add DRAFT_WEIGHT_BYTES / tp (from the published EAGLE3 draft); their KV
(one layer) is not counted, nor the vision tower's savings when multimodal is off. The estimate is for GPU profiles; the CPU profile serves the tiny model.
"""

from __future__ import annotations

from dataclasses import dataclass

from .catalog import HardwareProfile, get_profile
from .findings import Finding
from .model_geometry import GB, M3, MAX_CONTEXT_LENGTH, M3Geometry
from .schema import Recipe

#: KV element size per ``kvCache.dtype`` ("auto" serves the model dtype, bf16).
KV_DTYPE_BYTES = {"auto": 2, "bf16": 2, "fp8_e4m3": 1, "fp8_e5m2": 1}

#: How the fit counts MXFP8 weights, for the report.
MXFP8_LAYOUT = "mxfp8: quantized linears e4m3 + e8m0 scale per 32"

#: Bytes of the per-token fp32 scale beside an fp8 index key (``kvCache.indexKeyDtype: fp8_e4m3``).
INDEX_KEY_SCALE_BYTES = 4

#: Heuristic peak activation per prefill-chunk token, in multiples of one bf16 hidden state
#: (residual, norm output, q/k/v/o, MoE dispatch and combine buffers alive at once).
ACTIVATION_HIDDEN_STATES = 16

#: Heuristic memory CUDA graphs and the allocator keep outside the static pool, per GPU.
CUDA_GRAPH_RESERVE_BYTES = 2 * GB

#: Draft weights counted for speculative decoding: Inferact/MiniMax-M3-EAGLE3's model card
#: gives ~3.3 B parameters, stored in bf16; sharded over tp like the target.
DRAFT_WEIGHT_BYTES = int(3.3e9 * 2)

#: SGLang's default host/device pool ratio (--hicache-ratio) when no size is given.
HOST_TO_DEVICE_RATIO = 2

#: A fit is "tight" when the KV pool leaves less than this share of the static budget.
TIGHT_KV_SHARE = 0.10


@dataclass(frozen=True)
class FitReport:
    """The memory budget of one GPU rank and what it allows."""

    profile: str
    #: what the weights are counted as (bf16, or ``MXFP8_LAYOUT``)
    weight_layout: str
    memory_bytes: int
    mem_fraction_static: float
    weight_bytes_per_gpu: int
    draft_bytes_per_gpu: int
    kv_heads_per_rank: int
    kv_replication: int
    kv_bytes_per_token: int
    kv_pool_bytes: int
    pool_tokens: int
    #: the pool is limited by serving.maxTotalTokens rather than by memory
    pool_capped: bool
    reserve_bytes: int
    requests_per_group: int
    context_length: int
    max_context_at_concurrency: int
    max_concurrency_at_context: int
    #: hierarchical-cache host tier per rank (0: no host tier)
    host_pool_bytes: int = 0
    host_pool_tokens: int = 0
    #: sparse offload: host-store budget, bytes per token and tokens it holds; device block caches
    host_store_bytes: int = 0
    host_store_bytes_per_token: int = 0
    host_store_tokens: int = 0
    block_cache_bytes: int = 0
    #: KV page size in tokens (pools and host stores hold whole pages)
    page_size: int = 1

    @property
    def static_budget_bytes(self) -> int:
        return int(self.memory_bytes * self.mem_fraction_static)

    @property
    def reserve_budget_bytes(self) -> int:
        return self.memory_bytes - self.static_budget_bytes

    def findings(self) -> list[Finding]:
        return _fit_findings(self)

    def rows(self) -> list[tuple[str, str]]:
        """The report as (quantity, value) rows for a table."""
        gb = lambda n: f"{n / GB:,.2f} GB"  # noqa: E731
        replication = (
            f"each of the 4 KV heads on {self.kv_replication} ranks"
            if self.kv_replication > 1 else "not replicated"
        )
        return [
            ("GPU memory", f"{gb(self.memory_bytes)} ({self.profile})"),
            ("static budget (x memFractionStatic)",
             f"{gb(self.static_budget_bytes)} (x {self.mem_fraction_static})"),
            ("weight layout", self.weight_layout),
            ("weights per GPU (with draft)",
             f"{gb(self.weight_bytes_per_gpu)} (draft {gb(self.draft_bytes_per_gpu)})"),
            ("KV pool per GPU", gb(self.kv_pool_bytes)),
            ("KV heads per rank", f"{self.kv_heads_per_rank} ({replication})"),
            ("KV + index bytes per token per GPU", f"{self.kv_bytes_per_token:,}"
                                                    + (" (sparse layers' K/V on the host)" if self.host_store_bytes else "")),
            ("KV pool tokens", f"{self.pool_tokens:,}"
                               + (" (capped by maxTotalTokens)" if self.pool_capped else "")),
            ("runtime reserve needed / left", f"{gb(self.reserve_bytes)} / "
                                              f"{gb(self.reserve_budget_bytes)}"),
            ("requested: concurrency per attention group x context",
             f"{self.requests_per_group} x {self.context_length:,}"),
            ("largest context at requested concurrency", f"{self.max_context_at_concurrency:,}"),
            ("largest concurrency at requested context", f"{self.max_concurrency_at_context:,}"),
        ] + ([("host tier tokens (KV + index keys)",
               f"{self.host_pool_tokens:,} ({gb(self.host_pool_bytes)} sizeGbPerRank)")]
             if self.host_pool_bytes else []) + ([
            ("sparse-offload host store tokens", f"{self.host_store_tokens:,} ({gb(self.host_store_bytes)} "
                                                 f"sizeGbPerRank, {self.host_store_bytes_per_token:,} bytes per token)"),
            ("sparse-offload block caches per GPU", gb(self.block_cache_bytes)),
        ] if self.host_store_bytes else [])


def fit_applies(recipe: Recipe) -> bool:
    """The estimate models real M3 weights on GPUs; the CPU profile serves the tiny model."""
    return get_profile(recipe.spec.hardware.profile).is_gpu


def estimate_fit(recipe: Recipe, geometry: M3Geometry = M3) -> FitReport:
    """Memory budget of the fullest GPU rank of one replica of ``recipe``."""
    spec = recipe.spec
    profile = get_profile(spec.hardware.profile)
    parallel = spec.parallelism
    attention_tp = max(1, parallel.tp // parallel.attention_dp)

    draft = 0
    if spec.speculative is not None and spec.speculative.draft_model is not None:
        draft = DRAFT_WEIGHT_BYTES // parallel.tp
    weights = draft + weight_bytes_per_gpu(spec.model.variant, parallel.tp, parallel.pp,
                                           parallel.attention_dp, geometry)
    kv_heads = max(1, geometry.num_kv_heads // attention_tp)
    page = spec.kv_cache.page_size
    offload = sparse_offload(recipe)
    host_per_token = offloaded_bytes_per_token(spec.kv_cache.dtype, attention_tp, parallel.pp, geometry) if offload else 0
    per_token = kv_bytes_per_token(spec.kv_cache.dtype, attention_tp, parallel.pp, geometry,
                                   index_key_dtype=spec.kv_cache.index_key_dtype) - host_per_token
    # each sparse layer's cache holds its entries and one scratch entry (zeros read under masks);
    # its tables (8 bytes per entry and per pool page) are under 0.01% of that and left out
    block_caches = (offload.cache_blocks + 1) * page * host_per_token if offload else 0
    host_store = offload.size_gb_per_rank * 10**9 if offload else 0
    host_tokens = sparse_offload_host_tokens(host_store, host_per_token, page) if offload else 0
    static_budget = int(profile.memory_bytes * spec.serving.mem_fraction_static)
    kv_pool = max(0, static_budget - weights - block_caches)
    pool_tokens = (kv_pool // per_token) // page * page
    if offload:
        pool_tokens = min(pool_tokens, host_tokens)
    cap = spec.serving.max_total_tokens  # SGLang never allocates more than this many tokens
    pool_capped = cap is not None and cap < pool_tokens
    if pool_capped:
        pool_tokens = cap

    # SGLang gives each attention-DP worker max_running_requests // attentionDp (at least 1)
    requests = max(1, spec.serving.max_running_requests // parallel.attention_dp)
    max_context = min(MAX_CONTEXT_LENGTH, (pool_tokens // requests) // page * page)
    host_bytes = host_tier_bytes(recipe)
    return FitReport(
        profile=profile.name,
        weight_layout=MXFP8_LAYOUT if spec.model.variant == "mxfp8" else "bf16 (routers fp32)",
        memory_bytes=profile.memory_bytes,
        mem_fraction_static=spec.serving.mem_fraction_static,
        weight_bytes_per_gpu=weights,
        draft_bytes_per_gpu=draft,
        kv_heads_per_rank=kv_heads,
        kv_replication=max(1, attention_tp // geometry.num_kv_heads),
        kv_bytes_per_token=per_token,
        kv_pool_bytes=kv_pool,
        pool_tokens=pool_tokens,
        pool_capped=pool_capped,
        reserve_bytes=runtime_reserve_bytes(recipe, profile, geometry),
        requests_per_group=requests,
        context_length=spec.context_length,
        max_context_at_concurrency=max_context,
        max_concurrency_at_context=pool_tokens // spec.context_length,
        host_pool_bytes=host_bytes,
        host_pool_tokens=host_tier_tokens(host_bytes, per_token, page),
        host_store_bytes=host_store,
        host_store_bytes_per_token=host_per_token,
        host_store_tokens=host_tokens,
        block_cache_bytes=block_caches,
        page_size=page,
    )


def sparse_offload(recipe: Recipe):
    """The recipe's ``hostOffload`` when it is a sized sparse offload, else None."""
    offload = recipe.spec.host_offload
    if offload is None or offload.mode != "sparse-offload" or not offload.size_gb_per_rank or not offload.cache_blocks:
        return None
    return offload


def sparse_offload_host_tokens(host_bytes: int, bytes_per_token: int, page: int) -> int:
    """Slots whose sparse-layer K/V fit a host store of ``host_bytes``: whole pages, less the
    pool's padding page (the plugin caps SGLang's slot pool to this)."""
    return max(0, (host_bytes // bytes_per_token // page - 1) * page)


def sparse_offload_host_bytes_for(tokens: int, bytes_per_token: int, page: int) -> int:
    """The smallest host store whose :func:`sparse_offload_host_tokens` holds ``tokens``."""
    pages = -(-tokens // page) + 1  # the pool's padding page
    return pages * page * bytes_per_token


def host_tier_bytes(recipe: Recipe) -> int:
    """Host bytes per rank of the hierarchical-cache tier (SGLang's --hicache-size is in 1e9 B)."""
    offload = recipe.spec.host_offload
    if offload is None or offload.mode != "hierarchical-cache" or not offload.size_gb_per_rank:
        return 0
    return offload.size_gb_per_rank * 10**9


def host_tier_tokens(host_bytes: int, bytes_per_token: int, page: int) -> int:
    """Tokens of SGLang's host pool for that budget: whole pages plus its one padding page."""
    if host_bytes == 0:
        return 0
    return (host_bytes // bytes_per_token // page + 1) * page


def weight_bytes_per_gpu(variant: str, tp: int, pp: int, attention_dp: int = 1,
                         geometry: M3Geometry = M3) -> int:
    """Weight bytes of the fullest rank (see the module docstring for the rules)."""
    layout = geometry.weight_layout(variant)
    attention_tp = max(1, tp // attention_dp)
    ways = {"attention_tp": attention_tp, "kv_heads": min(attention_tp, geometry.num_kv_heads),
            "tp": tp, "experts": tp, "replicated": 1}

    def rank_bytes(groups: dict[str, int]) -> int:
        return sum(size // ways[group] for group, size in groups.items())

    stages = pipeline_stages(geometry.num_layers, pp)
    fullest = max(
        sum(rank_bytes(layout.layer_groups[layout.layer_kinds[layer]]) for layer in layers)
        + (rank_bytes(layout.first_stage) if index == 0 else 0)
        + (rank_bytes(layout.last_stage) if index == len(stages) - 1 else 0)
        for index, layers in enumerate(stages)
    )
    return fullest


def pipeline_stages(num_layers: int, pp: int) -> list[range]:
    """Layers of each pipeline stage as SGLang splits them: evenly, the remainder going one
    each to the last stages."""
    pp = min(pp, num_layers)  # stages past one layer each hold no layer (refused by the rules)
    base, remainder = divmod(num_layers, pp)
    stages, start = [], 0
    for stage in range(pp):
        size = base + (stage >= pp - remainder)
        stages.append(range(start, start + size))
        start += size
    return stages


def kv_bytes_per_token(kv_dtype: str, attention_tp: int, pp: int, geometry: M3Geometry = M3,
                       index_key_dtype: str = "bf16") -> int:
    """Main KV of every layer plus the index key of every sparse layer, on the fullest
    pipeline stage, for one token on one rank (in M3 the dense layers come first, so with
    pp > 1 the last stage, all sparse, is the fullest). The index key is in the model dtype
    (bf16) whatever ``kv_dtype`` is, or with ``index_key_dtype`` fp8_e4m3 fp8 plus its per-token
    scale, as the plugin's pool stores it."""
    element = KV_DTYPE_BYTES[kv_dtype]
    kv_heads = max(1, geometry.num_kv_heads // attention_tp)
    main_per_layer = 2 * kv_heads * geometry.head_dim * element
    if index_key_dtype == "fp8_e4m3":
        index_per_sparse_layer = geometry.index_key_dim + INDEX_KEY_SCALE_BYTES
    else:
        index_per_sparse_layer = geometry.index_key_dim * KV_DTYPE_BYTES["bf16"]

    def stage_bytes(layers: range) -> int:
        sparse = sum(geometry.layer_is_sparse[layer] for layer in layers)
        return len(layers) * main_per_layer + sparse * index_per_sparse_layer

    return max(stage_bytes(stage) for stage in pipeline_stages(geometry.num_layers, pp))


def offloaded_bytes_per_token(kv_dtype: str, attention_tp: int, pp: int, geometry: M3Geometry = M3) -> int:
    """Main K/V of the sparse layers of the fullest pipeline stage, one token on one rank: what
    sparse offload moves to the host store."""
    kv_heads = max(1, geometry.num_kv_heads // attention_tp)
    per_layer = 2 * kv_heads * geometry.head_dim * KV_DTYPE_BYTES[kv_dtype]
    return max(sum(geometry.layer_is_sparse[layer] for layer in stage) * per_layer
               for stage in pipeline_stages(geometry.num_layers, pp))


def runtime_reserve_bytes(recipe: Recipe, profile: HardwareProfile,
                          geometry: M3Geometry = M3) -> int:
    """Activations of one prefill chunk + fp32 logits of a full batch + CUDA graphs."""
    serving = recipe.spec.serving
    chunk = serving.chunked_prefill_size
    if chunk <= 0:
        chunk = recipe.spec.context_length  # unchunked: a whole prompt at once
    activations = chunk * geometry.hidden_size * 2 * ACTIVATION_HIDDEN_STATES
    logits = serving.max_running_requests * geometry.vocab_size * 4
    graphs = CUDA_GRAPH_RESERVE_BYTES if profile.is_gpu else 0
    return activations + logits + graphs


def _fit_findings(report: FitReport) -> list[Finding]:
    findings = []
    caches_took_it = report.block_cache_bytes and report.weight_bytes_per_gpu < report.static_budget_bytes
    if report.kv_pool_bytes == 0 and caches_took_it:
        # the weights fit: the sparse-offload block caches took what they left
        room = report.static_budget_bytes - report.weight_bytes_per_gpu
        findings.append(Finding(
            "error", "spec.hostOffload.cacheBlocks",
            f"the sparse-offload block caches need {report.block_cache_bytes / GB:,.1f} GB per GPU but the "
            f"weights leave {room / GB:.1f} GB of the static budget, so no KV pool remains; lower "
            f"cacheBlocks (one more block in every sparse layer costs "
            f"{report.page_size * report.host_store_bytes_per_token / 10**6:.1f} MB per GPU)",
            "fit.block-caches"))
        return findings
    if report.kv_pool_bytes == 0:
        findings.append(Finding(
            "error", "spec.parallelism",
            f"weights need {report.weight_bytes_per_gpu / GB:.1f} GB per GPU but only "
            f"{report.static_budget_bytes / GB:.1f} GB is available "
            f"({report.memory_bytes / GB:.0f} GB x memFractionStatic "
            f"{report.mem_fraction_static}); use more GPUs (raise tp or pp, add nodes) or a "
            f"smaller variant",
            "fit.weights"))
        return findings
    if report.pool_tokens < report.context_length:
        if report.host_store_bytes and report.pool_tokens == report.host_store_tokens and not report.pool_capped:
            # sparse offload: the host store, not the GPU, is what holds too few tokens
            needed_gb = -(-sparse_offload_host_bytes_for(report.context_length, report.host_store_bytes_per_token,
                                                         report.page_size) // 10**9)
            findings.append(Finding(
                "error", "spec.hostOffload.sizeGbPerRank",
                f"the sparse-offload host store holds {report.host_store_tokens:,} tokens per rank "
                f"({report.host_store_bytes_per_token:,} bytes each), less than one request of "
                f"contextLength {report.context_length:,}; raise sizeGbPerRank to at least {needed_gb} "
                f"or lower contextLength",
                "fit.host-store"))
        elif not report.pool_capped:  # a cap below the context is the max-total-tokens rule's
            findings.append(Finding(
                "error", "spec.contextLength",
                f"the KV pool holds {report.pool_tokens:,} tokens per GPU, less than one "
                f"request of contextLength {report.context_length:,}; lower contextLength to "
                f"at most {report.pool_tokens:,}, use an fp8 kvCache.dtype, or add GPUs",
                "fit.context"))
        return findings
    if report.max_concurrency_at_context < report.requests_per_group:
        findings.append(Finding(
            "warning", "spec.serving.maxRunningRequests",
            f"only {report.max_concurrency_at_context} request(s) of {report.context_length:,} "
            f"tokens fit the KV pool ({report.pool_tokens:,} tokens), fewer than the "
            f"{report.requests_per_group} requested per attention group; requests will queue "
            f"when all run at full context (lower maxRunningRequests to "
            f"{report.max_concurrency_at_context} to make the limit explicit)",
            "fit.concurrency"))
    if report.host_pool_bytes and report.host_pool_tokens <= report.pool_tokens:
        needed_gb = -(-HOST_TO_DEVICE_RATIO * report.pool_tokens * report.kv_bytes_per_token // 10**9)
        findings.append(Finding(
            "warning", "spec.hostOffload.sizeGbPerRank",
            f"the host tier holds {report.host_pool_tokens:,} tokens, no more than the GPU pool's "
            f"{report.pool_tokens:,}: prefixes evicted from the GPU find little room on the host; "
            f"raise sizeGbPerRank to about {needed_gb} ({HOST_TO_DEVICE_RATIO}x the GPU pool, "
            f"SGLang's default ratio)",
            "fit.host-tier"))
    if report.kv_pool_bytes < TIGHT_KV_SHARE * report.static_budget_bytes:
        findings.append(Finding(
            "warning", "spec.serving.memFractionStatic",
            f"the KV pool is only {report.kv_pool_bytes / GB:.1f} GB per GPU, under "
            f"{TIGHT_KV_SHARE:.0%} of the static budget: a weight-size estimate off by a few "
            f"percent would leave no KV; add GPUs or use a smaller variant",
            "fit.tight"))
    if report.reserve_bytes > report.reserve_budget_bytes:
        findings.append(Finding(
            "warning", "spec.serving.memFractionStatic",
            f"activations, logits and CUDA graphs need about {report.reserve_bytes / GB:.1f} "
            f"GB per GPU but memFractionStatic {report.mem_fraction_static} leaves "
            f"{report.reserve_budget_bytes / GB:.1f} GB; lower memFractionStatic or "
            f"chunkedPrefillSize",
            "fit.reserve"))
    return findings
