"""Entry point of the ``sglang.srt.plugins`` group: everything sglang-m3 changes in SGLang.

SGLang calls ``register()`` in every one of its processes. It registers the project's model
classes, parsers and multimodal processor and installs the hooks in ``HOOKS`` (SGLang applies them right after all
plugins ran). Every hook SGLang sees from this project is in that table, each with its reason;
``tests/test_plugin_hooks.py`` fails when a target no longer exists in the installed SGLang.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from sglang_m3.integration import hooks
from sglang_m3.multimodal.processor_files import read_processor_files_transformers_wrote
from sglang_m3.parsers import register_parsers, serving_hooks
from sglang_m3.speculative import hooks as speculative_hooks
from sglang_m3.quant.serving import m3_mxfp8_quantization


@dataclass(frozen=True)
class Hook:
    target: str
    kind: str  # a HookType name: BEFORE, AFTER, AROUND or REPLACE
    function: Callable
    reason: str


HOOKS: tuple[Hook, ...] = (
    Hook(
        "sglang.srt.model_loader.loader._get_quantization_config",
        "AROUND",
        m3_mxfp8_quantization,
        "An MXFP8 M3 checkpoint would make SGLang build MX-scaled FP8 linears (Blackwell-only "
        "GEMMs, none on the CPU); M3 keeps its MXFP8 linears with W8A16 kernels on CUDA and "
        "dequantizes each weight at load elsewhere.",
    ),
    Hook(
        "sglang.srt.configs.model_config.get_config",
        "AROUND",
        hooks.read_m3_config_first,
        "SGLang parses config.json with transformers' M3 config class, which converts or refuses "
        "some shipped fields under other names; the project's reader checks the file first, so a "
        "bad field is refused at start-up under its own name. The text config SGLang derives the "
        "context length from then holds the spec's max_position_embeddings (1,048,576 when the "
        "file has none; SGLang's own object had none and allowed 2,048 tokens).",
    ),
    Hook(
        "sglang.srt.utils.hf_transformers.processor._get_minimax_m31_processor",
        "AROUND",
        read_processor_files_transformers_wrote,
        "SGLang reads an M3 VL checkpoint's processor only from preprocessor_config.json in the "
        "published form; one whose processor transformers saved (processor_config.json, or its "
        "own form of that file) did not start. transformers reads the files it wrote.",
    ),
    Hook(
        "sglang.srt.managers.tokenizer_manager.TokenizerManager._validate_one_request",
        "BEFORE",
        hooks.refuse_out_of_vocabulary_ids,
        "SGLang does not check a prompt's token ids against the vocabulary; one out of range "
        "crashed the server in the embedding lookup. M3 prompts are refused with the id named.",
    ),
    Hook(
        "sglang.srt.arg_groups.model_hook.handle_language_model_only",
        "AROUND",
        hooks.allow_language_model_only_for_m3,
        "SGLang serves --language-model-only only for the architectures on its allow-list and "
        "refused M3's at start-up (a recipe's multimodal.enabled: false renders it); M3 serves text "
        "alone with it (no vision tower built or loaded, media requests refused), so M3's "
        "architectures pass that check. Other models meet the list unchanged.",
    ),
    Hook(
        "sglang.srt.configs.model_config.is_minimax_sparse",
        "REPLACE",
        hooks.upstream_minimax_sparse_wiring_off,
        "Upstream keys its own M3 KV pool (which refuses out-of-tree platforms), sparse backend, "
        "server-arg overrides and CUDA-graph limits on this predicate; with it False SGLang treats "
        "M3 as an MHA model and the hooks below install this project's pool and backend instead.",
    ),
    Hook(
        "sglang.srt.layers.attention.attention_registry.attn_backend_wrapper",
        "AROUND",
        hooks.wrap_with_msa_backend,
        "Sparse layers of M3 run the project's MSA backend; dense layers keep SGLang's backend.",
    ),
    Hook(
        "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator._build_mha_kv_pool",
        "AROUND",
        hooks.build_indexed_kv_pool,
        "M3 needs the index key of every token beside its K/V at the same slot: swap in the "
        "index-aware subclass of SGLang's MHA pool.",
    ),
    Hook(
        "sglang.srt.model_executor.pool_configurator.DefaultPoolConfigurator._compute_cell_size",
        "AFTER",
        hooks.add_index_key_bytes,
        "The KV budget must count the index keys, or the pool would overrun its memory share; under "
        "sparse offload it must not count the sparse layers' K/V, which live in host memory.",
    ),
    Hook(
        "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator.config_from_budget",
        "AROUND",
        hooks.reserve_block_caches,
        "Under sparse offload the per-layer block caches are device memory beside the slot pool (a "
        "fixed part and a page table that grows with the pool): taken off the KV budget before the "
        "pool is sized, or pool and caches together would overrun it; caches larger than the budget, "
        "and SGLang's post-capture resize (which would take them off twice), are refused by name.",
    ),
    Hook(
        "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator._apply_token_constraints",
        "AFTER",
        hooks.cap_tokens_by_host_budget,
        "Under sparse offload every slot also costs host memory: the pool gets no more slots than "
        "SGLANG_M3_SPARSE_OFFLOAD_HOST_GB holds, and a budget below one full-length request is refused.",
    ),
    Hook(
        "sglang.srt.entrypoints.openai.serving_chat.OpenAIServingChat.__init__",
        "AFTER",
        serving_hooks.adopt_m3_chat_rules,
        "Upstream maps thinking / reasoning_effort onto thinking_mode (and checks tool-call "
        "pairing) only for model_type minimax_m3_vl, and keys forced reasoning on the literal "
        "parser name minimax-m3: extend both to the text-only model and the minimax_m3 alias.",
    ),
    Hook(
        "sglang.srt.entrypoints.openai.serving_chat.OpenAIServingChat._patch_reasoning_skip_special_tokens",
        "AFTER",
        serving_hooks.keep_m3_markers_in_output,
        "M3's think tags and tool-call namespace must survive detokenization for the parsers, "
        "also when the tokenizer marks them special and the request skips special tokens.",
    ),
    Hook(
        "sglang.srt.sampling.sampling_params.SamplingParams.verify",
        "AFTER",
        speculative_hooks.refuse_sampled_requests_when_speculating_on_cpu,
        "SGLang verifies sampled drafts only with a CUDA kernel: on the CPU platform a sampled "
        "request to a speculating server killed the scheduler; it gets a 400 naming the fields.",
    ),
    Hook(
        "sglang.srt.arg_groups.speculative_hook._handle_eagle_family",
        "AFTER",
        speculative_hooks.check_m3_eagle_args,
        "Speculative set-ups SGLang accepts but that crash with M3 are refused at start-up naming the "
        "flag or field: NEXTN/EAGLE without a draft or with M3 itself as the draft (no M3 MTP draft "
        "model exists), EAGLE(3) drafts of the wrong width or with aux layers past the target's depth, "
        "draft trees with more verify tokens than the draft proposes, fewer than steps + 1, or more than "
        "64 (the MSA plans' ancestor mask).",
    ),
    Hook(
        "sglang.srt.models.llama_eagle3.LlamaForCausalLMEagle3.__init__",
        "BEFORE",
        speculative_hooks.default_absent_draft_vocab_size,
        "SGLang reads an EAGLE3 draft's draft_vocab_size unconditionally; a draft config without the "
        "(optional) key died in the scheduler with an AttributeError. It gets the full vocabulary "
        "when the draft has its own lm_head, else SGLang's null (the target's lm_head).",
    ),
    Hook(
        "sglang.srt.arg_groups.speculative_hook._handle_ngram",
        "AFTER",
        speculative_hooks.refuse_ngram_for_m3,
        "NGRAM's irregular draft trees are not attended by MSA: an M3 server with NGRAM is refused "
        "at start-up, naming the flag, instead of failing at its first verify batch.",
    ),
    Hook(
        "sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend.forward_extend",
        "AROUND",
        speculative_hooks.torch_native_extend_with_verify,
        "SGLang's torch-native attention (the CPU platform's) cannot run a TARGET_VERIFY batch; "
        "EAGLE chains are verified there with the drafts attended causally after the prefix.",
    ),
    Hook(
        "sglang.srt.speculative.draft_utils.DraftBackendFactory.create_decode_backend",
        "AROUND",
        speculative_hooks.torch_native_draft_decode_backend,
        "SGLang has no multi-step draft backend for torch-native attention; EAGLE drafts on the "
        "CPU platform decode with this project's (chains).",
    ),
    Hook(
        "sglang.srt.speculative.draft_utils.DraftBackendFactory.create_draft_extend_backend",
        "AROUND",
        speculative_hooks.torch_native_draft_extend_backend,
        "SGLang's draft-extend factory lists no torch-native entry although that backend serves "
        "draft extends as they are; the CPU platform's drafts extend through it.",
    ),
    Hook(
        "sglang.srt.speculative.draft_utils.DraftBackendFactory._create_triton_prefill_backend",
        "AROUND",
        speculative_hooks.triton_draft_extend_on_msa_kernels,
        "SGLang's Triton extend kernel gives each (request, head) of a draft's extend over the verify "
        "window one program walking the whole prefix (167 us per chain-of-3 cycle at 2K on the H200); "
        "for an M3 target the MSA decode kernels attend that window split over the keys (22.7 against "
        "121.5 us at 2K, 103 against 2,198 us at 32K; SGLANG_M3_DRAFT_EXTEND=sglang keeps SGLang's).",
    ),
    Hook(
        "sglang.kernels.ops.speculative.spec_tree.build_tree_kernel_efficient_func",
        "AROUND",
        speculative_hooks.build_tree_in_torch_on_cpu,
        "SGLang refuses out-of-tree platforms at EAGLE tree construction; the CPU platform builds "
        "the tree with torch (SGLang's Triton builder would need TRITON_INTERPRET=1 there).",
    ),
    Hook(
        "sglang.kernels.ops.speculative.spec_tree.verify_tree_greedy_func",
        "AROUND",
        speculative_hooks.verify_greedy_in_torch_on_cpu,
        "Likewise for greedy verification of the drafts: torch on the CPU platform.",
    ),
    Hook(
        "sglang.kernels.ops.speculative.cache_locs.assign_draft_cache_locs_contiguous_func",
        "AROUND",
        speculative_hooks.draft_cache_locs_in_torch_on_cpu,
        "Out-of-tree platforms get SGLang's Triton copy of the drafts' cache slots, which runs on "
        "a CPU only in Triton's interpreter; the CPU platform copies them with torch.",
    ),
    Hook(
        "sglang.kernels.ops.speculative.eagle.fill_bonus_tokens_func",
        "AROUND",
        speculative_hooks.bonus_tokens_in_torch_on_cpu,
        "After verify SGLang picks each request's bonus token with a Triton kernel off its own CPU "
        "engine; the CPU platform picks it with torch.",
    ),
    Hook(
        "sglang.kernels.ops.speculative.cache_locs.fill_front_out_cache_loc_func",
        "AROUND",
        speculative_hooks.front_cache_locs_in_torch_on_cpu,
        "After a draft tree's verify SGLang moves the accepted path's K/V to the front of each "
        "request's window, packing the target slots with Triton off its own CPU engine; the CPU "
        "platform packs them with torch.",
    ),
    Hook(
        "sglang.kernels.ops.speculative.eagle.fill_accept_out_cache_loc_func",
        "AROUND",
        speculative_hooks.accepted_cache_locs_in_torch_on_cpu,
        "Likewise for the source slots of that move (the accepted tokens): torch on the CPU platform.",
    ),
    Hook(
        "sglang.srt.mem_cache.allocation.assign_req_to_token_pool_func",
        "AROUND",
        speculative_hooks.req_to_token_in_torch_on_cpu,
        "Speculative decode steps write their new slots into the request-to-token table with a "
        "Triton kernel off SGLang's own CPU engine; the CPU platform writes them with torch.",
    ),
    Hook(
        "sglang.srt.mem_cache.memory_pool.MHATokenToKVPool._init_kv_copy_and_warmup",
        "AROUND",
        speculative_hooks.native_kv_move_on_cpu,
        "Speculative servers enable the KV pool's Triton slot copy and launch it once at start-up; "
        "the CPU platform moves slots with SGLang's torch path instead (no interpreter needed).",
    ),
)


def register() -> None:
    """Register models, parsers and hooks with SGLang (idempotent per process)."""
    from sglang.srt.models.registry import ModelRegistry, import_model_classes
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from sglang_m3.cache.host_pool import register_m3_host_stack
    from sglang_m3.integration.long_prompt_warmup import register_long_prompt_warmup
    from sglang_m3.multimodal.sglang_processor import register_multimodal_processor

    # Added to whatever the registry holds, replacing upstream's M3 classes. Not
    # ModelRegistry.register(): that first imports every SGLang model, even when
    # SGLANG_EXTERNAL_MODEL_PACKAGE=sglang_m3.models asked SGLang to skip them.
    ModelRegistry.models.update(import_model_classes("sglang_m3.models", strict=True))
    register_parsers()
    register_multimodal_processor()
    # SGLang's public extension point for host (hierarchical) cache stacks, not a hook: the M3
    # pool needs a host pool that also carries its index keys (sglang_m3/cache/host_pool.py).
    register_m3_host_stack()
    # SGLang's registry of named start-up warm-ups (``--warmups``), not a hook either.
    register_long_prompt_warmup()
    for hook in HOOKS:
        HookRegistry.register(hook.target, hook.function, HookType[hook.kind])

