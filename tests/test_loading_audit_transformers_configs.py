"""Audit: checkpoints saved by transformers with geometries the other tests never build load and
compute what transformers' ``minimax_m3_vl`` computes.

Each case is a ``MiniMaxM3VLConfig`` saved by transformers (``save_pretrained``, weights re-drawn
as the tiny builders do), its config.json rewritten into the shipped layout (M3_FACTS s.1; the
"hf" cases keep transformers' own file). Varied, one case or another: ``head_dim`` unlike
hidden / heads (smaller, larger, not a power of two), 1 KV head, KV heads = query heads,
``partial_rotary_factor`` 0.1 / 0.25 / 0.5 / 1.0 (with and without ``rotary_dim``), RoPE
theta, the sparse schedule (first layer sparse, all sparse, all dense, alternating), the index
branch (head dim below / above ``head_dim``, block sizes 1, 3, 4, 8, 16, 128, top-k past the
visible blocks, 0 and 2 local blocks), dense MLP layers first / between / last / everywhere, MoE
everywhere, 1 to 16 experts, top-1 to all experts, a shared expert twice the routed width
(``n_shared_experts`` 2), the swiglu constants, ``routed_scaling_factor``, ``rms_norm_eps``,
tied embeddings, an odd vocabulary, intermediate widths that are no multiple of 8 or of 64, bf16
and fp16 checkpoints, one file or sharded with an index json, and vision towers unlike the text
model (wider than it, 1 and 3 layers, patch 14, merge 1 and 3, temporal patch 1, a wide projector).

In process (cheap): the VL class is built and fed SGLang's own weight stream through
``load_weights``; its text model runs with RadixAttention replaced by the exact MSA semantics
(``msa_kernels.reference``, float64) on sparse layers and causal GQA on dense ones, and its prompt
logprobs are compared with transformers'. The MSA kernels and backends are checked elsewhere; here
the object is the loading and every config-dependent module around attention. Measured: at most
2.1e-5 apart (float32), so ``IN_PROCESS_TOLERANCE`` is 1e-4. The vision rows are compared with
the vision-tower test's tolerances. Two cases are then served by the real CPU server and compared
with transformers as every served test does (greedy tokens identical, logprobs within 2e-3).

Two transformers-saved configs whose two spellings of one setting disagree (``rotary_dim`` left at
transformers' default beside a factor; tied at the top level only) are read as transformers reads
them (``test_disagreeing_spellings_saved_by_transformers_compute_as_transformers``).
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from torch import nn
from test_checkpoint_loading_edge_cases import read_tensors
from transformers_oracle import load_reference_model, prompt_logprobs, random_prompt

from sglang_m3.config import M3TextSpec
from tests.e2e.transformers_saved import rewrite_in_shipped_layout

#: max |ours - transformers| prompt logprob in process (measured 2.1e-5, module docstring)
IN_PROCESS_TOLERANCE = 1e-4
DEFAULT_VISION = {"hidden_size": 40, "num_hidden_layers": 2, "num_attention_heads": 5, "intermediate_size": 72, "patch_size": 8}


def rope(factor: float, theta: float = 5_000_000.0) -> dict:
    return {"rope_type": "default", "rope_theta": theta, "partial_rotary_factor": factor}


def schedule(sparse: list[int], moe: list[int]) -> dict:
    """Per-layer attention and MLP kinds in transformers' spelling (1 = MSA / MoE)."""
    return {
        "num_hidden_layers": len(sparse),
        "layer_types": ["minimax_m3_sparse" if s else "full_attention" for s in sparse],
        "mlp_layer_types": ["sparse" if m else "dense" for m in moe],
    }


def text(**changes) -> dict:
    """The base text config (4 layers: dense first, then MSA + MoE) with ``changes``."""
    settings = {
        "vocab_size": 512, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "rotary_dim": 8, "rope_parameters": rope(0.5), **schedule([0, 1, 1, 1], [0, 1, 1, 1]),
        "num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 32, "shared_intermediate_size": 32,
        "dense_intermediate_size": 48, "index_n_heads": 2, "index_head_dim": 16, "index_block_size": 8,
        "index_topk_blocks": 3, "index_local_blocks": 1, "max_position_embeddings": 4096,
    }
    settings.update(changes)
    return settings


#: name -> (text config, options): ``vision`` (the tower's sizes), ``dtype``, ``save`` (options of
#: ``save_pretrained``), ``layout`` ("shipped" or "hf"), ``keep_rotary_dim``, ``n_shared_experts``
CASES = {
    "head_dim24_one_kv_head_all_sparse_tied": (
        text(head_dim=24, rotary_dim=12, num_key_value_heads=1, index_n_heads=1, num_local_experts=5, num_experts_per_tok=3,
             tie_word_embeddings=True, **schedule([1, 1, 1, 1], [1, 0, 1, 1])),
        {},
    ),
    "mha_all_dense_attention_full_rope_bf16_sharded": (
        text(hidden_size=48, num_key_value_heads=4, head_dim=8, rotary_dim=8, rope_parameters=rope(1.0), index_n_heads=4,
             index_head_dim=8, num_experts_per_tok=1, **schedule([0, 0, 0], [0, 1, 1])),
        {"dtype": torch.bfloat16, "save": {"max_shard_size": "40KB"}},
    ),
    "head_dim32_quarter_rope_wide_index_no_local_block_alternating": (
        text(num_attention_heads=8, head_dim=32, rope_parameters=rope(0.25), index_head_dim=64, index_block_size=16,
             index_topk_blocks=2, index_local_blocks=0, routed_scaling_factor=1.0, rms_norm_eps=1e-5,
             **schedule([0, 1, 0, 1], [1, 1, 1, 1])),
        {},
    ),
    "swiglu_constants_all_experts_two_shared_theta1e4": (
        text(swiglu_limit=2.0, swiglu_alpha=1.3, num_local_experts=8, num_experts_per_tok=8, shared_intermediate_size=64,
             rope_parameters=rope(0.5, 10_000.0)),
        {"n_shared_experts": 2},
    ),
    "block4_top4_two_local_blocks_narrow_index": (
        text(index_block_size=4, index_topk_blocks=4, index_local_blocks=2, index_head_dim=8),
        {},
    ),
    "block1_and_odd_vocab_mha5_wide_vision": (
        text(vocab_size=509, hidden_size=80, num_attention_heads=5, num_key_value_heads=5, index_n_heads=5,
             dense_intermediate_size=40, intermediate_size=24, shared_intermediate_size=24, index_block_size=1),
        {"vision": {"hidden_size": 96, "num_hidden_layers": 1, "num_attention_heads": 3, "intermediate_size": 200, "patch_size": 14}},
    ),
    "block3_top5_seven_mixed_layers": (
        text(index_block_size=3, index_topk_blocks=5, index_local_blocks=2, **schedule([1, 0, 0, 1, 1, 0, 1], [0, 1, 0, 1, 0, 1, 1])),
        {},
    ),
    "block128_topk_past_visible_blocks": (text(index_block_size=128, index_topk_blocks=20), {}),
    "dense_mlps_only": (text(**schedule([0, 1, 1, 1], [0, 0, 0, 0])), {}),
    "dense_mlp_last_one_expert": (text(num_local_experts=1, num_experts_per_tok=1, **schedule([1, 1, 0], [1, 1, 0])), {}),
    "head_dim40_tenth_rope_mha3": (
        text(hidden_size=72, num_attention_heads=3, num_key_value_heads=3, head_dim=40, rotary_dim=4, rope_parameters=rope(0.1),
             index_n_heads=3, index_head_dim=12),
        {},
    ),
    "head_dim20_theta100_no_rotary_dim_key": (
        text(head_dim=20, rotary_dim=10, rope_parameters=rope(0.5, 100.0), index_head_dim=20),
        {"keep_rotary_dim": False},
    ),
    "widths_no_multiple_of_8_or_64_fp16_sharded": (
        text(intermediate_size=20, shared_intermediate_size=100, dense_intermediate_size=130, num_local_experts=16, num_experts_per_tok=6),
        {"dtype": torch.float16, "save": {"max_shard_size": "30KB"}},
    ),
    "one_kv_head_eight_query_heads_vision_merge3": (
        text(num_attention_heads=8, num_key_value_heads=1, index_n_heads=1),
        {"vision": {**DEFAULT_VISION, "spatial_merge_size": 3, "patch_size": 14}},
    ),
    "vision_merge1_temporal1_three_layers": (
        text(),
        {"vision": {"hidden_size": 24, "num_hidden_layers": 3, "num_attention_heads": 2, "intermediate_size": 40,
                    "spatial_merge_size": 1, "temporal_patch_size": 1}},
    ),
    "hf_layout_head_dim24_one_kv_head_tied": (
        text(head_dim=24, rotary_dim=12, num_key_value_heads=1, index_n_heads=1, tie_word_embeddings=True, **schedule([1, 0, 1], [1, 1, 0])),
        {"layout": "hf"},
    ),
    "hf_layout_block4_local2_bf16": (
        text(index_block_size=4, index_topk_blocks=4, index_local_blocks=2), {"layout": "hf", "dtype": torch.bfloat16},
    ),
}
PROMPTS = {"p40": random_prompt(40, 40), "p97": random_prompt(97, 97)}


def save_checkpoint(directory: str, text_settings: dict, vision: dict | None = None, dtype=torch.float32, top: dict | None = None,
                    **save_options) -> str:
    """The tokenizer and a random ``MiniMaxM3VLConfig`` model saved by transformers into ``directory``
    (``top``: more arguments of the VL config; ``save_options``: of ``save_pretrained``)."""
    from transformers.models.minimax_m3_vl import MiniMaxM3SparseForConditionalGeneration, MiniMaxM3VLConfig

    from sglang_m3.parsers import chat_template_path
    from sglang_m3.tiny.checkpoint import MAX_POSITIONS, redraw_weights
    from sglang_m3.tiny.tokenizer import BOS, EOS, IMAGE_TOKEN, VIDEO_TOKEN, build_tokenizer, save_tokenizer

    os.makedirs(directory, exist_ok=True)
    settings = dict(text_settings)
    special = save_tokenizer(directory, build_tokenizer(settings["vocab_size"]), chat_template_path().read_text(), MAX_POSITIONS)
    settings.update(bos_token_id=special[BOS], eos_token_id=special[EOS])
    config = MiniMaxM3VLConfig(
        text_config=settings, vision_config=dict(vision or DEFAULT_VISION),
        **{"projector_hidden_size": settings["hidden_size"], "image_token_index": special[IMAGE_TOKEN],
           "video_token_index": special[VIDEO_TOKEN], **(top or {})},
    )
    torch.manual_seed(0)
    model = MiniMaxM3SparseForConditionalGeneration(config)
    redraw_weights(model, 0)
    model.to(dtype).save_pretrained(directory, **save_options)
    return directory


def build_case(directory: str, name: str) -> str:
    settings, options = CASES[name]
    save_checkpoint(directory, settings, options.get("vision"), options.get("dtype", torch.float32), **options.get("save", {}))
    if options.get("layout", "shipped") == "shipped":
        rewrite_in_shipped_layout(directory, options.get("keep_rotary_dim", True), options.get("n_shared_experts"))
    return directory


class ExactAttention(nn.Module):
    """Stands in for RadixAttention of one layer: M3's MSA from its definition on sparse layers
    (``msa_kernels.reference``), causal GQA on dense ones; float64. ``positions`` is set per call."""

    def __init__(self, spec: M3TextSpec, layer_id: int, heads: int, kv_heads: int, head_dim: int):
        super().__init__()
        from msa_kernels.reference import MSAParams

        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.sparse = spec.sparse_layers[layer_id]
        self.params = MSAParams(spec.index_block_size, spec.index_topk_blocks, spec.index_local_blocks, spec.index_init_blocks) if self.sparse else None
        self.positions: torch.Tensor | None = None

    def forward(self, q, k, v, forward_batch, index_q=None, index_k=None, **extra):
        from msa_kernels.reference import msa_attention

        tokens = q.shape[0]
        q = q.view(tokens, self.heads, self.head_dim).double()
        k = k.view(tokens, self.kv_heads, self.head_dim).double()
        v = v.view(tokens, self.kv_heads, self.head_dim).double()
        scale = self.head_dim**-0.5
        if self.sparse:
            assert index_q is not None and index_k is not None, "a sparse layer must hand over its index branch"
            out, _ = msa_attention(q, k, v, index_q.double(), index_k.double(), self.positions, self.params, scale=scale)
        else:
            group = self.heads // self.kv_heads
            scores = torch.einsum("thd,shd->hts", q, k.repeat_interleave(group, 1)) * scale
            scores = scores.masked_fill(torch.ones(tokens, tokens, dtype=torch.bool).triu(1), float("-inf"))
            out = torch.einsum("hts,shd->thd", scores.softmax(-1), v.repeat_interleave(group, 1))
        return out.reshape(tokens, self.heads * self.head_dim).float()


def sglang_weight_stream(model_dir: str):
    """The checkpoint's tensors as SGLang's loader streams them (index-filtered files, threads)."""
    from sglang.srt.model_loader.weight_utils import buffered_multi_thread_safetensors_weights_iterator, filter_duplicate_safetensors_files

    files = sorted(os.path.join(model_dir, f) for f in os.listdir(model_dir) if f.endswith(".safetensors"))
    files = filter_duplicate_safetensors_files(files, model_dir, "model.safetensors.index.json")
    return buffered_multi_thread_safetensors_weights_iterator(files, max_workers=2)


def loaded_model(model_dir: str):
    """The VL class built for ``model_dir`` (float32, as the served tests run) and loaded from SGLang's stream."""
    from test_checkpoint_loading_edge_cases import build, loaded

    from sglang_m3.models.minimax_m3_vl import MiniMaxM3SparseForConditionalGeneration

    model = build(MiniMaxM3SparseForConditionalGeneration, model_dir)
    loaded(model, sglang_weight_stream(model_dir))
    for layer_id, layer in enumerate(model.model.layers):
        attention = layer.self_attn
        attention.attn = ExactAttention(model.spec, layer_id, attention.num_heads, attention.num_kv_heads, attention.head_dim)
    return model.eval()


@torch.no_grad()
def our_prompt_logprobs(model, prompt: list[int]) -> torch.Tensor:
    from fused_attn_cases import as_rank

    ids, positions = torch.tensor(prompt), torch.arange(len(prompt))
    for layer in model.model.layers:
        layer.self_attn.attn.positions = positions
    with as_rank():
        hidden = model.model(ids, positions, None)
    logits = hidden @ model.lm_head.weight[: model.spec.vocab_size].T
    return logits[:-1].float().log_softmax(-1).gather(1, ids[1:, None])[:, 0]


@pytest.mark.parametrize("name", list(CASES))
def test_transformers_saved_checkpoint_loads_and_computes_as_transformers(name, tmp_path):
    from tests.multimodal.test_vision_tower import reference_rows

    model_dir = build_case(str(tmp_path), name)
    settings, options = CASES[name]
    sharded = "model.safetensors.index.json" in os.listdir(model_dir)
    assert sharded == ("save" in options)
    model = loaded_model(model_dir)
    assert (model.spec.hidden_size, model.spec.head_dim, model.spec.num_kv_heads) == (
        settings["hidden_size"], settings["head_dim"], settings["num_key_value_heads"])
    assert model.spec.tie_word_embeddings == settings.get("tie_word_embeddings", False)
    for label, prompt in PROMPTS.items():
        prompt = [token % (settings["vocab_size"] - 20) + 20 for token in prompt]  # ordinary tokens of the vocabulary
        diff = (our_prompt_logprobs(model, prompt) - prompt_logprobs(model_dir, prompt)).abs().max().item()
        assert diff < IN_PROCESS_TOLERANCE, f"{name} {label}: prompt logprobs differ from transformers' by {diff}"
    merge = model.vision.dims.spatial_merge_size
    grids = [[1, 2 * merge, 3 * merge], [2, merge, 2 * merge]]
    pixels = torch.randn(sum(t * h * w for t, h, w in grids), model.vision.dims.patch_dim, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(model.vision(pixels, torch.tensor(grids)), reference_rows(load_reference_model(model_dir), pixels, grids),
                                   rtol=1e-4, atol=1e-5)


def _rotary_dim_left_at_transformers_default(directory: str) -> str:
    """``partial_rotary_factor`` 0.5 of a 16-wide head set, ``rotary_dim`` not: transformers writes
    its class default 64 beside it (and never reads it; it rotates 8 channels)."""
    settings = {key: value for key, value in text().items() if key != "rotary_dim"}
    save_checkpoint(directory, settings)
    rewrite_in_shipped_layout(directory)
    return directory


def _tied_at_the_top_level_only(directory: str) -> str:
    """``MiniMaxM3VLConfig(tie_word_embeddings=True)`` with an untied text config: transformers
    ties (its VL config reads the top level) and saves no lm_head; the text config says false."""
    save_checkpoint(directory, text(), top={"tie_word_embeddings": True})
    assert not any("lm_head" in name for name in read_tensors(directory))
    rewrite_in_shipped_layout(directory)
    return directory


@pytest.mark.parametrize("make", [_rotary_dim_left_at_transformers_default, _tied_at_the_top_level_only],
                         ids=["rotary_dim-default-vs-factor", "tie-top-level-only"])
def test_disagreeing_spellings_saved_by_transformers_compute_as_transformers(make, tmp_path):
    """Two configs transformers writes and runs whose two spellings of one setting disagree: read
    as transformers reads them (``partial_rotary_factor`` over ``rotary_dim``; tied when either
    level says so), they load and give transformers' prompt logprobs."""
    model_dir = make(str(tmp_path))
    with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as handle:
        top = json.load(handle)
    assert top["text_config"]["tie_word_embeddings"] is False
    model = loaded_model(model_dir)
    vocab = top["text_config"]["vocab_size"]
    for label, prompt in PROMPTS.items():
        prompt = [token % (vocab - 20) + 20 for token in prompt]
        diff = (our_prompt_logprobs(model, prompt) - prompt_logprobs(model_dir, prompt)).abs().max().item()
        assert diff < IN_PROCESS_TOLERANCE, f"{label}: prompt logprobs differ from transformers' by {diff}"


#: served cases: the first also serves an image and a video, the second prefills in chunks of 37
#: tokens (not a multiple of its 16-token MSA blocks)
SERVED = {
    "head_dim24_one_kv_head_all_sparse_tied": (),
    "head_dim32_quarter_rope_wide_index_no_local_block_alternating": ("--chunked-prefill-size", "37"),
}


@pytest.mark.server
@pytest.mark.parametrize("name", list(SERVED))
def test_served_transformers_saved_checkpoint_matches_transformers(name, tmp_path, server_log_dir):
    from server_harness import launch_cpu_server

    from sglang_m3.tiny.checkpoint import transformers_processor
    from tests.e2e.served_vs_reference import assert_matches_reference
    from tests.multimodal.test_e2e_vision_server import CASES as MEDIA_CASES
    from tests.multimodal.vl_oracle import generate, oracle_tokens, processed, served_tokens

    model_dir = build_case(str(tmp_path / "checkpoint"), name)
    transformers_processor(model_dir).save_pretrained(model_dir)
    with launch_cpu_server(model_dir, server_log_dir, *SERVED[name]) as server:
        for length in (6, 97, 233):
            assert_matches_reference(server, model_dir, random_prompt(length, length), f"{name} p{length}")
        if not SERVED[name]:
            for media in ("one image", "video"):
                prompt, images, video = MEDIA_CASES[media]
                inputs = processed(model_dir, prompt, images, video)
                result = generate(server, prompt, images, video)
                assert result["meta_info"]["prompt_tokens"] == inputs["input_ids"].shape[1]
                assert served_tokens(result) == oracle_tokens(model_dir, inputs), f"{name}: {media} differs"
