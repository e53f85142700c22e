"""The speculative-decoding hook functions listed in ``sglang_m3.plugin.HOOKS``.

Each imports SGLang only when called, so the plugin module stays light.
"""

from __future__ import annotations

TORCH_NATIVE = "torch_native"


def check_m3_eagle_args(result, server_args):
    """AFTER SGLang resolves EAGLE/EAGLE3 arguments: refuse settings an M3 target cannot serve."""
    from sglang.srt.arg_groups.model_override_base import model_config_of, resolved_view

    from sglang_m3.integration.hooks import is_m3, spec_of
    from sglang_m3.speculative.checks import TargetShape, check_eagle_settings

    model_config = model_config_of(server_args)
    if not is_m3(model_config.hf_config):
        return result
    spec = spec_of(model_config)
    view = resolved_view(server_args)
    check_eagle_settings(
        view.speculative_algorithm,
        view.speculative_eagle_topk,
        view.speculative_draft_model_path,
        TargetShape(spec.hidden_size, spec.vocab_size, spec.num_layers, spec.num_mtp_modules),
        view.speculative_num_draft_tokens,
        view.speculative_num_steps,
    )
    return result


def default_absent_draft_vocab_size(draft, config=None, *args, **kwargs):
    """BEFORE ``LlamaForCausalLMEagle3.__init__``: a draft config without ``draft_vocab_size`` gets one.

    SGLang 0.5.23 reads ``config.draft_vocab_size`` unconditionally there, and transformers'
    LlamaConfig has no such attribute when the file lacks the key, so such a draft (the key is
    optional: the draft then speaks the full vocabulary) died in the scheduler with an
    AttributeError. It becomes ``vocab_size`` when the draft carries its own ``lm_head``, else
    None, which SGLang reads as "use the target's lm_head" (``absent_draft_vocab_size``). The
    draft's directory is the config's ``name_or_path``, which SGLang's ``get_config`` (AutoConfig) sets.
    """
    from sglang_m3.speculative.draft_tensors import absent_draft_vocab_size

    if config is not None and not hasattr(config, "draft_vocab_size"):
        config.draft_vocab_size = absent_draft_vocab_size(config.name_or_path, config.vocab_size)


def refuse_ngram_for_m3(result, server_args):
    """AFTER SGLang resolves NGRAM arguments: an M3 target refuses NGRAM at start-up.

    NGRAM verifies irregular draft trees (``tree_topk`` -1), which every MSA path refuses
    (``msa.batch_shape.verify_q_len``). SGLang itself refuses NGRAM's default breadth at page size
    128, but ``--speculative-ngram-max-bfs-breadth 1`` passes its checks: on CUDA the server would
    load and fail at its first verify batch (read from the code, not run), and on the CPU platform
    its scheduler died importing NGRAM's worker (no ``sgl_kernel``). This names the flag before any
    model loads.
    """
    from sglang.srt.arg_groups.model_override_base import model_config_of

    from sglang_m3.integration.hooks import is_m3

    if is_m3(model_config_of(server_args).hf_config):
        raise ValueError(
            "--speculative-algorithm NGRAM: NGRAM verifies irregular draft trees (SGLang's tree_topk -1), which "
            "M3's sparse attention does not attend; use --speculative-algorithm EAGLE3 with an M3 draft"
        )
    return result


def torch_native_extend_with_verify(original, backend, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
    """AROUND ``TorchNativeAttnBackend.forward_extend``: TARGET_VERIFY batches attend their drafts."""
    if not forward_batch.forward_mode.is_target_verify():
        return original(backend, q, k, v, layer, forward_batch, save_kv_cache, **kwargs)
    from sglang_m3.speculative.torch_native import verify_extend

    return verify_extend(backend, q, k, v, layer, forward_batch, save_kv_cache)


def torch_native_draft_decode_backend(original, factory):
    """AROUND ``DraftBackendFactory.create_decode_backend``: a torch-native multi-step draft backend."""
    from sglang.srt.runtime_context import attention_backends

    backend_type = factory.draft_attn_backend or attention_backends()[1]
    if backend_type != TORCH_NATIVE or factory.speculative_num_steps <= 1 or factory.qsa_profile is not None:
        return original(factory)
    from sglang_m3.speculative.torch_native import TorchNativeMultiStepDraftBackend

    return TorchNativeMultiStepDraftBackend(factory.draft_model_runner, factory.topk, factory.speculative_num_steps)


def torch_native_draft_extend_backend(original, factory):
    """AROUND ``DraftBackendFactory.create_draft_extend_backend``: draft extends are ordinary extend
    batches, which SGLang's torch-native backend serves as it is."""
    from sglang.srt.runtime_context import attention_backends, get_spec

    prefill, decode = attention_backends()
    backend_type = factory.draft_attn_backend or (decode if get_spec().speculative_attention_mode == "decode" else prefill)
    if backend_type != TORCH_NATIVE or factory.qsa_profile is not None:
        return original(factory)
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    backend = TorchNativeAttnBackend(factory.draft_model_runner)
    backend.prefill_attention_backend_str = backend.decode_attention_backend_str = TORCH_NATIVE
    return backend


def triton_draft_extend_on_msa_kernels(original, factory):
    """AROUND ``DraftBackendFactory._create_triton_prefill_backend`` (the ``triton`` draft-extend
    backend): for an M3 target on CUDA, the draft's extends over the verify window run on the MSA
    decode kernels (:mod:`sglang_m3.speculative.draft_extend`); any other target keeps SGLang's."""
    import torch
    from sglang.srt.arg_groups.model_override_base import model_config_of

    from sglang_m3.integration.hooks import is_m3, spec_of
    from sglang_m3.speculative import draft_extend

    runner = factory.draft_model_runner
    device = torch.device(runner.device)
    target = model_config_of(runner.server_args)
    if device.type != "cuda" or not is_m3(target.hf_config) or not draft_extend.enabled():
        return original(factory)
    spec = spec_of(target)
    if runner.page_size != spec.index_block_size:
        return original(factory)
    from sglang_m3.msa.backend import msa_params_of
    from sglang_m3.msa.triton_backend import sm_count

    plans = draft_extend.DraftExtendPlans(
        runner.req_to_token_pool.req_to_token, runner.token_to_kv_pool, msa_params_of(spec), runner.model_config.context_len,
        sm_count(device), device,
    )
    return "triton", draft_extend.triton_backend_class()(runner, plans, skip_prefill=False)


def _on_cpu_platform() -> bool:
    from sglang.srt.platforms import current_platform

    from sglang_m3.platform.cpu_platform import TorchNativeCpuPlatform

    return isinstance(current_platform, TorchNativeCpuPlatform)


def build_tree_in_torch_on_cpu(original, *args, **kwargs):
    """AROUND ``build_tree_kernel_efficient_func``: on the CPU platform, the torch tree builder
    (SGLang refuses out-of-tree platforms there; its Triton builder needs a GPU or the interpreter)."""
    if not _on_cpu_platform():
        return original(*args, **kwargs)
    from sglang_m3.speculative.torch_kernels import build_tree

    return build_tree(*args, **kwargs)


def verify_greedy_in_torch_on_cpu(original, *args, **kwargs):
    """AROUND ``verify_tree_greedy_func``: on the CPU platform, the torch greedy verifier."""
    if not _on_cpu_platform():
        return original(*args, **kwargs)
    from sglang_m3.speculative.torch_kernels import verify_tree_greedy

    kwargs.pop("topk", None)  # the tree's branching: read from the retrieve links instead
    return verify_tree_greedy(*args, **kwargs)


def draft_cache_locs_in_torch_on_cpu(original, *args, **kwargs):
    """AROUND ``assign_draft_cache_locs_contiguous_func``: on the CPU platform, the torch copy of
    each request's draft slots (SGLang launches a Triton kernel on out-of-tree platforms)."""
    if not _on_cpu_platform():
        return original(*args, **kwargs)
    from sglang_m3.speculative.torch_kernels import assign_draft_cache_locs

    return assign_draft_cache_locs(*args, **kwargs)


def bonus_tokens_in_torch_on_cpu(original, *args, **kwargs):
    """AROUND ``fill_bonus_tokens_func``: on the CPU platform, the torch pick of each request's
    last accepted token after verify (SGLang launches Triton off its own CPU engine)."""
    if not _on_cpu_platform():
        return original(*args, **kwargs)
    from sglang_m3.speculative.torch_kernels import fill_bonus_tokens

    return fill_bonus_tokens(*args, **kwargs)


def front_cache_locs_in_torch_on_cpu(original, *args, **kwargs):
    """AROUND ``fill_front_out_cache_loc_func``: on the CPU platform, the torch packing of the slots
    an accepted tree path moves to (SGLang launches Triton off its own CPU engine)."""
    if not _on_cpu_platform():
        return original(*args, **kwargs)
    from sglang_m3.speculative.torch_kernels import fill_front_out_cache_loc

    return fill_front_out_cache_loc(*args, **kwargs)


def accepted_cache_locs_in_torch_on_cpu(original, *args, **kwargs):
    """AROUND ``fill_accept_out_cache_loc_func``: on the CPU platform, the torch packing of the slots
    of a tree's accepted tokens (SGLang launches Triton off its own CPU engine)."""
    if not _on_cpu_platform():
        return original(*args, **kwargs)
    from sglang_m3.speculative.torch_kernels import fill_accept_out_cache_loc

    return fill_accept_out_cache_loc(*args, **kwargs)


def req_to_token_in_torch_on_cpu(original, *args, **kwargs):
    """AROUND ``assign_req_to_token_pool_func``: on the CPU platform, the torch write of new
    slots into the request-to-token table (SGLang launches Triton off its own CPU engine)."""
    if not _on_cpu_platform():
        return original(*args, **kwargs)
    from sglang_m3.speculative.torch_kernels import assign_req_to_token

    return assign_req_to_token(*args, **kwargs)


def native_kv_move_on_cpu(original, pool):
    """AROUND ``MHATokenToKVPool._init_kv_copy_and_warmup``: on the CPU platform, SGLang's torch
    slot move (``use_native_move_kv_cache``) instead of its Triton byte copy and that copy's
    warm-up launch. Speculative servers enable the copy (accepted drafts move their KV)."""
    if not _on_cpu_platform():
        return original(pool)
    pool._kv_copy_config = None
    pool.use_native_move_kv_cache = True


def refuse_sampled_requests_when_speculating_on_cpu(result, sampling_params, vocab_size):
    """A sampled request on a CPU speculative server is refused with a 400 naming the fields.

    SGLang 0.5.23 verifies sampled (non-greedy) drafts only with a CUDA kernel; off CUDA that
    function is None and calling it killed the scheduler (measured on the CPU platform with
    temperature 0.8), taking every other request down with it.
    """
    if sampling_params.top_k <= 1 or not _on_cpu_platform():
        return result
    from sglang.srt.runtime_context import get_spec

    if get_spec().speculative_algorithm:
        raise ValueError(
            "this server speculates on the CPU platform, which verifies greedy requests only: "
            f"send temperature 0 or top_k 1 (got temperature {sampling_params.temperature}, top_k {sampling_params.top_k})"
        )
    return result
