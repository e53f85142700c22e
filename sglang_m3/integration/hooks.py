"""The hook functions listed in ``sglang_m3.plugin.HOOKS``.

Each one recognises an M3 model by its architecture name and leaves every other model to SGLang
untouched.
"""

from __future__ import annotations

import json
import logging
import os

logger = logging.getLogger(__name__)

M3_ARCHITECTURES = ("MiniMaxM3SparseForCausalLM", "MiniMaxM3SparseForConditionalGeneration")


def is_m3(hf_config) -> bool:
    return (getattr(hf_config, "architectures", None) or [None])[0] in M3_ARCHITECTURES


def first_architecture(config: object) -> object:
    """The architecture a config.json's contents name first: ``architectures[0]``, the value itself
    when it is a single name, None for an empty list or contents that are not a JSON object. Every
    reader of a config file decides "is this M3?" by it (``in M3_ARCHITECTURES``)."""
    names = config.get("architectures") if isinstance(config, dict) else None
    return (names[0] if names else None) if isinstance(names, list) else names


def spec_of(model_config):
    """The validated ``M3TextSpec`` of an SGLang ``ModelConfig`` (cached per config object)."""
    return _spec_for(model_config.hf_config, model_config.model_path)


def _spec_for(hf_config, model_path):
    from sglang_m3.config import M3TextSpec

    cached = getattr(hf_config, "_sglang_m3_spec", None)
    if cached is None:
        cached = M3TextSpec.from_config(hf_config, model_path)
        hf_config._sglang_m3_spec = cached
    return cached


def read_m3_config_first(original, model, *args, model_override_args=None, **kwargs):
    """Validate a local M3 checkpoint's config with the project's reader before SGLang parses it.

    SGLang's launcher parses ``config.json`` through transformers' M3 config class first, whose
    own checks (and silent conversions) would otherwise decide what a bad field is called, or let
    it through; this way a refusal names the checkpoint's own field. The parsed config then gets
    the spec's context length (``_state_context_length``).
    """
    path = os.path.join(model, "config.json") if isinstance(model, str) else None
    spec = None
    if path and os.path.isfile(path):
        with open(path, encoding="utf-8") as handle:
            architecture = first_architecture(json.load(handle))
        if architecture in M3_ARCHITECTURES:
            from sglang_m3.config import M3TextSpec

            spec = M3TextSpec.from_config(None, model, overrides=model_override_args or {})
    config = original(model, *args, model_override_args=model_override_args, **kwargs)
    if spec is not None:
        _state_context_length(config, spec)
    return config


def _state_context_length(config, spec) -> None:
    """SGLang's text config gets the spec's ``max_position_embeddings``, the length SGLang derives
    the context from (the checkpoint's value, or M3's 1,048,576 when the field is absent).

    Without the field, SGLang's object had none (the shipped ``minimax_m2`` text type is no
    transformers class): the server derived a 2,048-token context and refused a longer
    ``--context-length``; transformers' text class would have put in its own 524,288.
    """
    text = getattr(config, "text_config", None) or config
    if isinstance(text, dict):  # SGLang's MiniMaxM3VLConfig keeps it a dict until get_hf_text_config
        text["max_position_embeddings"] = spec.max_position_embeddings
        sections = [text.get(key) for key in _ROPE_SECTIONS]
    else:
        text.max_position_embeddings = spec.max_position_embeddings
        sections = [getattr(text, key, None) for key in _ROPE_SECTIONS]
    _drop_plain_rope_factor(sections)


#: where a config states its RoPE type and factor (transformers 5 reads the older name as the newer)
_ROPE_SECTIONS = ("rope_scaling", "rope_parameters")


def _drop_plain_rope_factor(sections) -> None:
    """A ``factor`` in the RoPE section leaves SGLang's context length that many times the
    checkpoint's positions, though M3's RoPE is plain (the spec refuses any other type) and takes
    no factor, as in transformers. Dropped from SGLang's parsed object only; the file is untouched."""
    for section in sections:
        if isinstance(section, dict) and section.pop("factor", None) is not None:
            logger.info("RoPE 'factor' ignored: M3's RoPE is plain, the context stays max_position_embeddings")


def refuse_out_of_vocabulary_ids(tokenizer_manager, obj, input_ids, *args, **kwargs):
    """A prompt id outside the embedding's rows is refused with the request, naming the first one.

    SGLang 0.5.23 checks a prompt's length but not its ids; the embedding lookup then failed
    inside the scheduler (an ``IndexError`` on the CPU, a device-side assert on CUDA) and took the
    whole server down with every request in flight. A ``ValueError`` here becomes the request's
    400 answer (``min``/``max`` over a 32K-id list take well under a millisecond).
    """
    if not input_ids or not is_m3(tokenizer_manager.model_config.hf_config):
        return None
    vocab = tokenizer_manager.model_config.vocab_size
    if min(input_ids) < 0 or max(input_ids) >= vocab:
        at, token = next((i, t) for i, t in enumerate(input_ids) if t < 0 or t >= vocab)
        raise ValueError(f"input_ids[{at}] = {token} is not a token id of this model: ids run from 0 to {vocab - 1}")
    return None


def allow_language_model_only_for_m3(original, server_args):
    """AROUND SGLang's check of ``--language-model-only``: M3's architectures pass it.

    SGLang 0.5.23 serves the flag only for the architectures on its allow-list
    (``ServerArgs.LANGUAGE_MODEL_ONLY_ARCHITECTURES``) and refused M3's at start-up, though M3
    serves text alone with it: ``ModelConfig`` writes the flag onto the config, the VL class then
    builds and loads no vision tower, and SGLang builds no media processor and refuses media
    requests. For an M3 model the check runs with M3's architectures on the list (its other
    checks, the flags it does not combine with, as they are); other models meet the list unchanged.
    """
    from sglang.srt.arg_groups.model_override_base import model_config_of, resolving_view

    if not resolving_view(server_args).language_model_only or not is_m3(model_config_of(server_args).hf_config):
        return original(server_args)
    record = type(server_args)
    allowed = record.LANGUAGE_MODEL_ONLY_ARCHITECTURES
    record.LANGUAGE_MODEL_ONLY_ARCHITECTURES = (*allowed, *M3_ARCHITECTURES)
    try:
        return original(server_args)
    finally:
        record.LANGUAGE_MODEL_ONLY_ARCHITECTURES = allowed


def upstream_minimax_sparse_wiring_off(config) -> bool:
    return False


def wrap_with_msa_backend(original, runner, full_attn_backend):
    if not is_m3(runner.model_config.hf_config):
        return original(runner, full_attn_backend)
    import torch

    from sglang.srt.runtime_context import get_parallel, get_schedule

    from sglang_m3.msa.dense_prefill import SDPADensePrefill, prebuild_chunk_plans, prepare_cudnn, sdpa_dense_prefill_enabled
    from sglang_m3.msa.hybrid import M3HybridAttnBackend

    spec = spec_of(runner.model_config)
    dense = original(runner, full_attn_backend)
    dense_prefill = None
    device = torch.device(runner.device)
    if sdpa_dense_prefill_enabled(device):
        dense_prefill = SDPADensePrefill(runner)
        attn_tp_size = get_parallel().attn_tp_size
        if device.type == "cuda":
            widths = (spec.num_heads // attn_tp_size, runner.model_config.get_num_kv_heads(attn_tp_size), spec.head_dim, runner.dtype, device)
            seconds = prepare_cudnn(*widths)
            logger.info("sglang-m3: dense prefill's cuDNN attention prepared in %.2f s", seconds)
            # the resolved chunk (the runtime context's; the runner's copy of the arguments may leave it unset)
            chunk = get_schedule().chunked_prefill_size or 0
            shapes, seconds = prebuild_chunk_plans(*widths, chunk=chunk, context=runner.model_config.context_len)
            logger.info("sglang-m3: cuDNN plans of %d full prefill chunks (chunk %d, context %d) built in %.2f s",
                        shapes, chunk, runner.model_config.context_len, seconds)
    return M3HybridAttnBackend(dense, _sparse_backend(runner, spec), spec.sparse_layer_ids, dense_prefill,
                               _dense_attention_layers(runner.model, spec.sparse_layer_ids))


def _dense_attention_layers(model, sparse_layer_ids) -> list:
    """The loaded model's attention modules of its dense layers (the hybrid asks whether the MSA
    backend can attend each; the model is loaded before SGLang builds its attention backends)."""
    from sglang.srt.layers.radix_attention import RadixAttention

    sparse = frozenset(sparse_layer_ids)
    return [module for module in model.modules() if isinstance(module, RadixAttention) and module.layer_id not in sparse]


def _sparse_backend(runner, spec):
    """The offload backend where the pool offloads (``sglang_m3.cache.offload_pool``): the Triton one
    when its K/V move through device kernels (CUDA), the torch one otherwise; else the device one."""
    from sglang_m3.cache.offload_pool import M3SparseOffloadKVPool
    from sglang_m3.msa.triton_backend import msa_backend_for

    pool = runner.token_to_kv_pool
    if isinstance(pool, M3SparseOffloadKVPool):
        if pool.uses_kernels:
            from sglang_m3.msa.offload_triton_backend import MSAOffloadTritonBackend

            return MSAOffloadTritonBackend(runner, spec)
        from sglang_m3.msa.offload_backend import MSAOffloadTorchBackend

        return MSAOffloadTorchBackend(runner, spec)
    return msa_backend_for(runner, spec)


def build_indexed_kv_pool(original, configurator, *, max_total_num_tokens, mha_pool_class, quant_method=None):
    if not is_m3(configurator.model_config.hf_config):
        return original(configurator, max_total_num_tokens=max_total_num_tokens, mha_pool_class=mha_pool_class, quant_method=quant_method)
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    spec = spec_of(configurator.model_config)
    spec.validate_page_size(configurator.pool_page_size)
    if quant_method is not None or not issubclass(mha_pool_class, MHATokenToKVPool):
        raise NotImplementedError("sglang-m3's index-aware KV pool supports the plain MHA layout only")
    return original(
        configurator,
        max_total_num_tokens=max_total_num_tokens,
        mha_pool_class=_m3_pool_class(configurator, spec),
        quant_method=quant_method,
    )


def refuse_attention_data_parallel(attn_dp_size: int) -> None:
    """Refuse ``--attn-dp-size`` > 1 before the KV pool is sized for it: M3's attention here splits
    its heads over the whole tensor-parallel group, while attention data parallelism gives each
    attention group its own batch and sizes the pool for ``tp / attn-dp`` ranks' KV heads."""
    if attn_dp_size > 1:
        raise ValueError(
            f"--attn-dp-size {attn_dp_size}: sglang-m3's M3 attention splits its heads over the whole "
            "tensor-parallel group and does not serve attention data parallelism; run with --attn-dp-size 1 "
            "(--dp-size gives data-parallel replicas)"
        )


def refuse_disaggregation(disaggregation_mode: str) -> None:
    """Refuse ``--disaggregation-mode prefill`` / ``decode`` before the KV pool is built: SGLang's
    prefill -> decode transfer lists an MHA pool's buffers as every layer's K then every layer's V and
    splits that list by halves, layers and heads (pipeline stages, differing TP), which the index keys
    beside them fit none of; a decode instance would select blocks from index keys it never received."""
    if disaggregation_mode in ("prefill", "decode"):
        raise ValueError(
            f"--disaggregation-mode {disaggregation_mode}: SGLang's KV transfer moves each layer's K and V but not "
            "the index keys sglang-m3 keeps beside them, so the decode instance would choose M3's sparse blocks from "
            "index keys it never received; serve M3 without prefill/decode disaggregation (--disaggregation-mode null)"
        )


def _m3_pool_class(configurator, spec):
    """The sparse-offload pool when ``SGLANG_M3_SPARSE_OFFLOAD_BLOCKS`` asks for it (checked against
    the server's settings), else the index-key pool."""
    from sglang.srt.runtime_context import get_disagg, get_parallel

    from sglang_m3.cache.index_kv_pool import indexed_pool_class
    from sglang_m3.cache.offload_pool import offload_pool_class
    from sglang_m3.cache.offload_settings import OffloadShape, check_sparse_offload, max_query_tokens, sparse_offload_blocks

    parallel = get_parallel()
    refuse_attention_data_parallel(parallel.attn_dp_size)
    refuse_disaggregation(get_disagg().disaggregation_mode)
    blocks = sparse_offload_blocks()
    if not blocks:
        return indexed_pool_class(spec, configurator.model_dtype)
    shape = OffloadShape(
        cache_blocks=blocks, block_size=spec.index_block_size, topk=spec.index_topk_blocks,
        kv_heads=configurator.model_config.get_num_kv_heads(parallel.attn_tp_size, parallel.attn_dcp_size),
        max_query_tokens=max_query_tokens(configurator.server_args))
    check_sparse_offload(shape, configurator.server_args, configurator.device, configurator.pool_page_size)
    return offload_pool_class(spec, configurator.model_dtype, shape)


def add_index_key_bytes(cell_size, pool_configurator, kvc, num_layers):
    if not is_m3(kvc.model_config.hf_config):
        return cell_size
    from sglang_m3.cache.index_kv_pool import index_bytes_per_token
    from sglang_m3.cache.offload_settings import sparse_offload_blocks

    spec = spec_of(kvc.model_config)
    info = kvc.layer_info
    index_bytes = index_bytes_per_token(spec, info.start_layer, info.end_layer, kvc.kv_cache_dtype, model_dtype=kvc.model_dtype)
    # under sparse offload the sparse layers' K/V live in the host store, not in device memory
    offloaded = _offloaded_bytes_per_token(kvc, spec) if sparse_offload_blocks() else 0
    return cell_size + index_bytes - offloaded


def reserve_block_caches(original, kvc, budget_bytes, *, cap_tokens=None):
    """AROUND SGLang's pool sizing from a byte budget: under sparse offload the block caches are
    device memory beside the slot pool, taken off the KV budget before the pool is sized (or pool and
    caches together would overrun it). What comes off is what they allocate: a fixed part and a page
    table that grows with the pool (``_block_caches_bytes``). The tables of the largest pool the rest
    of the budget holds bound those of any smaller one; the pool sized beside those is then held to
    its size with its own tables taken off. Caches that take the whole budget, and SGLang's
    post-capture resize (which would take them off twice), are refused by name."""
    blocks = _sparse_offload_blocks(kvc)
    if not blocks:
        return original(kvc, budget_bytes, cap_tokens=cap_tokens)
    from sglang_m3.cache.offload_budget import check_block_caches_fit, check_no_post_capture_sizing

    check_no_post_capture_sizing(blocks, kvc.post_capture_kv_active)
    caches_bytes = _block_caches_bytes(kvc, spec_of(kvc.model_config), blocks)
    check_block_caches_fit(blocks, caches_bytes(0), budget_bytes)
    most = original(kvc, budget_bytes - caches_bytes(0), cap_tokens=cap_tokens).max_total_num_tokens
    tokens = original(kvc, budget_bytes - caches_bytes(most), cap_tokens=cap_tokens).max_total_num_tokens
    return original(kvc, budget_bytes - caches_bytes(tokens), cap_tokens=tokens)


def _sparse_offload_blocks(kvc) -> int:
    """Block-cache entries per sparse layer of this configurator's model: 0 unless M3 under sparse offload."""
    from sglang_m3.cache.offload_settings import sparse_offload_blocks

    return sparse_offload_blocks() if is_m3(kvc.model_config.hf_config) else 0


def _block_caches_bytes(kvc, spec, blocks: int):
    """Device bytes of this rank's block caches (one per local sparse layer, as the offload pool builds
    them) as a function of the slot pool's tokens: each cache's page table spans the pool's slots,
    its padding page included, in MSA blocks."""
    from sglang.srt.runtime_context import get_parallel, get_schedule

    from sglang_m3.cache.offload_block_cache import block_cache_bytes, store_pages

    parallel = get_parallel()
    info = kvc.layer_info
    sparse = sum(1 for layer in spec.sparse_layer_ids if info.start_layer <= layer < info.end_layer)
    kv_heads = kvc.model_config.get_num_kv_heads(parallel.attn_tp_size, parallel.attn_dcp_size)
    page_size = get_schedule().page_size

    def caches_bytes(pool_tokens: int) -> int:
        pages = store_pages(pool_tokens, page_size, spec.index_block_size)
        return sparse * block_cache_bytes(blocks, pages, spec.index_block_size, kv_heads, spec.head_dim, spec.head_dim,
                                          kvc.kv_cache_dtype.itemsize)

    return caches_bytes


def _offloaded_bytes_per_token(kvc, spec) -> int:
    from sglang.srt.runtime_context import get_parallel

    from sglang_m3.cache.offload_budget import offloaded_bytes_per_token

    info = kvc.layer_info
    sparse = sum(1 for layer in spec.sparse_layer_ids if info.start_layer <= layer < info.end_layer)
    kv_heads = kvc.model_config.get_num_kv_heads(get_parallel().attn_tp_size)
    return offloaded_bytes_per_token(sparse, kv_heads, spec.head_dim, spec.head_dim, kvc.kv_cache_dtype.itemsize)


def cap_tokens_by_host_budget(capacity, kvc, token_capacity):
    """AFTER SGLang's token constraints: no more slots than the sparse-offload host budget holds."""
    if not is_m3(kvc.model_config.hf_config):
        return capacity
    from sglang.srt.runtime_context import get_schedule

    from sglang_m3.cache.offload_budget import check_budget_has_offload, check_host_room, host_budget_bytes
    from sglang_m3.cache.offload_settings import sparse_offload_blocks
    from sglang_m3.recipe.fit import sparse_offload_host_tokens

    budget = host_budget_bytes()
    check_budget_has_offload(budget, sparse_offload_blocks())
    if budget is None:
        return capacity
    per_token = _offloaded_bytes_per_token(kvc, spec_of(kvc.model_config))
    cap = sparse_offload_host_tokens(budget, per_token, get_schedule().page_size)
    check_host_room(cap, kvc.model_config.context_len, budget, per_token, get_schedule().page_size)
    return min(capacity, cap)
