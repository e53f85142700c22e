"""The speculative-decoding hook functions listed in ``sglang_m3.plugin.HOOKS``.

Each imports SGLang only when called, so the plugin module stays light.
"""

from __future__ import annotations

TORCH_NATIVE = "torch_native"


def check_m3_eagle_args(result, server_args):
    """AFTER SGLang resolves EAGLE/EAGLE3 arguments: refuse settings an M3 target cannot serve."""
    from sglang.srt.arg_groups.model_override_base import model_config_of, resolved_view

    from sglang_m3.integration.hooks import is_m3
    from sglang_m3.speculative.checks import TargetShape, check_eagle_settings

    hf_config = model_config_of(server_args).hf_config
    if not is_m3(hf_config):
        return result
    text = getattr(hf_config, "text_config", None) or hf_config
    view = resolved_view(server_args)
    check_eagle_settings(
        view.speculative_algorithm,
        view.speculative_eagle_topk,
        view.speculative_draft_model_path,
        TargetShape(text.hidden_size, text.vocab_size, text.num_hidden_layers),
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


def _on_cpu_platform() -> bool:
    from sglang.srt.platforms import current_platform

    from sglang_m3.platform.cpu_platform import TorchNativeCpuPlatform

    return isinstance(current_platform, TorchNativeCpuPlatform)


def build_tree_with_triton_on_cpu(original, *args, **kwargs):
    """AROUND ``build_tree_kernel_efficient_func``: on the CPU platform, SGLang's own Triton tree
    builder (its XPU path), which runs in Triton's interpreter (``TRITON_INTERPRET=1``), as
    SGLang's draft cache-location kernel already does there."""
    if not _on_cpu_platform():
        return original(*args, **kwargs)
    from sglang.kernels.ops.speculative.spec_tree import sgl_build_tree_kernel_triton

    return sgl_build_tree_kernel_triton(*args, **kwargs)


def verify_greedy_with_triton_on_cpu(original, *args, **kwargs):
    """AROUND ``verify_tree_greedy_func``: on the CPU platform, SGLang's Triton greedy verifier."""
    if not _on_cpu_platform():
        return original(*args, **kwargs)
    from sglang.kernels.ops.speculative.spec_tree import verify_tree_greedy_triton

    kwargs.pop("topk", None)  # the tree's branching: read from the retrieve links instead
    verify_tree_greedy_triton(**kwargs)
    return kwargs["predicts"], kwargs["accept_index"], kwargs["accept_token_num"]
