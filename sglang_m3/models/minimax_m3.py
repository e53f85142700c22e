"""MiniMax M3 text model for SGLang (architecture ``MiniMaxM3SparseForCausalLM``).

Layers 0..2 of the real model use dense attention and a dense MLP; the rest use MiniMax Sparse
Attention (MSA) and MoE (the per-layer schedule comes from the config). A sparse layer computes
the usual q/k/v plus an *index branch* (index queries per KV group and one shared index key); it
hands both to ``RadixAttention`` and the MSA backend installed by the plugin stores the index key
beside the main KV (same slot) and attends only the blocks the index selects.
"""

from __future__ import annotations

import logging
import math
import re
from collections import Counter
from importlib.metadata import version
from typing import Iterable

import torch
from sglang.srt.distributed.parallel_state import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
from sglang.srt.layers.linear import QKVParallelLinear, ReplicatedLinear, RowParallelLinear
from sglang.srt.layers.logits_processor import LogitsProcessor
from sglang.srt.layers.radix_attention import RadixAttention
from sglang.srt.layers.utils import PPMissingLayer
from sglang.srt.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, PPProxyTensors
from sglang.srt.model_loader.weight_utils import default_weight_loader
from sglang.srt.utils import make_layers
from torch import nn

from sglang_m3.config import M3TextSpec
from sglang_m3.models.checkpoint_layout import (
    IGNORED_PREFIXES,
    PACKED,
    RENAMED,
    CheckpointError,
    canonical_dense_mlp_name,
    expected_text_tensors,
    is_derived_buffer,
    missing_tensor_spellings,
    refuse_quantized_tensor,
    text_tensor_name,
)
from sglang_m3.models.fused_attn_ops import fused_attn_ops_on, norm_rope_fused
from sglang_m3.models.fused_norm import add_rmsnorm
from sglang_m3.models.layers import M3RMSNorm, PartialNeoxRotary
from sglang_m3.models.fused_moe import make_moe_block
from sglang_m3.models.moe import GatedMLP
from sglang_m3.models.moe_routing import prepare_half_router
from sglang_m3.models.pipeline import PipelineStage, pipeline_stage
from sglang_m3.speculative.aux_layers import resolve_aux_layer_ids
from sglang_m3.quant.loading import ROUTED_EXPERT, MXFP8Dequantizer, MXFP8Weight
from sglang_m3.quant.mxfp8 import WEIGHT_DTYPE

logger = logging.getLogger(__name__)

_EXPERT = re.compile(r"^(model\.layers\.\d+)\.block_sparse_moe\.experts\.(\d+)\.(w1|w2|w3)\.weight$")
_SHARED_EXPERT = re.compile(r"^(model\.layers\.\d+)\.block_sparse_moe\.shared_experts\.(gate|up|down)_proj\.weight$")


class M3Attention(nn.Module):
    """GQA with per-head q/k norms and partial RoPE; on sparse layers also the MSA index branch."""

    def __init__(self, spec: M3TextSpec, layer_id: int, quant_config=None, prefix: str = ""):
        super().__init__()
        tp_size, tp_rank = get_tensor_model_parallel_world_size(), get_tensor_model_parallel_rank()
        if spec.num_heads % tp_size:
            raise ValueError(f"num_attention_heads ({spec.num_heads}) is not divisible by the tensor-parallel size ({tp_size})")
        if spec.num_kv_heads % tp_size and tp_size % spec.num_kv_heads:
            # SGLang's QKV layer splits KV heads over the ranks, or replicates them evenly when there
            # are fewer heads than ranks; anything else failed inside it on a bare assertion.
            raise ValueError(
                f"num_key_value_heads ({spec.num_kv_heads}) neither splits over nor evenly replicates across "
                f"the tensor-parallel ranks (--tp-size {tp_size}): choose a --tp-size that it divides or that divides it"
            )
        self.head_dim = spec.head_dim
        self.num_heads = spec.num_heads // tp_size
        self.num_kv_heads = max(1, spec.num_kv_heads // tp_size)
        self.qkv_proj = QKVParallelLinear(
            spec.hidden_size, spec.head_dim, spec.num_heads, spec.num_kv_heads,
            bias=False, quant_config=quant_config, prefix=f"{prefix}.qkv_proj",
        )
        self.o_proj = RowParallelLinear(
            spec.num_heads * spec.head_dim, spec.hidden_size, bias=False, quant_config=quant_config, prefix=f"{prefix}.o_proj"
        )
        self.q_norm = M3RMSNorm(spec.head_dim, spec.rms_norm_eps, spec.use_gemma_norm)
        self.k_norm = M3RMSNorm(spec.head_dim, spec.rms_norm_eps, spec.use_gemma_norm)
        self.rotary = PartialNeoxRotary(spec.rotary_dim, spec.rope_theta)
        self.attn = RadixAttention(
            self.num_heads, spec.head_dim, 1.0 / math.sqrt(spec.head_dim), self.num_kv_heads,
            layer_id=layer_id, quant_config=quant_config, prefix=f"{prefix}.attn",
        )
        self.is_sparse = spec.sparse_layers[layer_id]
        if self.is_sparse:
            self.index_heads, self.index_head_dim = spec.index_heads, spec.index_head_dim
            # One index head per KV group: this rank keeps the heads of the KV groups it serves
            # (KV heads are replicated when tp > num_kv_heads, and so are their index heads).
            if tp_size <= spec.num_kv_heads:
                first = tp_rank * self.num_kv_heads
            else:
                first = tp_rank // (tp_size // spec.num_kv_heads)
            self.local_index_heads = slice(first, first + self.num_kv_heads)
            self.index_q_proj = ReplicatedLinear(spec.hidden_size, spec.index_heads * spec.index_head_dim, bias=False, prefix=f"{prefix}.index_q_proj")
            self.index_k_proj = ReplicatedLinear(spec.hidden_size, spec.index_head_dim, bias=False, prefix=f"{prefix}.index_k_proj")
            self.index_q_norm = M3RMSNorm(spec.index_head_dim, spec.rms_norm_eps, spec.use_gemma_norm)
            self.index_k_norm = M3RMSNorm(spec.index_head_dim, spec.rms_norm_eps, spec.use_gemma_norm)

    def index_branch(self, positions: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(index queries ``[T, local KV heads, Di]``, index keys ``[T, Di]``), normed and rotated."""
        tokens = hidden.shape[0]
        iq, _ = self.index_q_proj(hidden)
        ik, _ = self.index_k_proj(hidden)
        iq = self.index_q_norm(iq.view(tokens, self.index_heads, self.index_head_dim))[:, self.local_index_heads]
        ik = self.index_k_norm(ik.view(tokens, 1, self.index_head_dim))
        iq, ik = self.rotary(positions, iq, ik)
        return iq.contiguous(), ik.view(tokens, self.index_head_dim)

    def fused_norm_rope(self, positions: torch.Tensor, hidden: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """The GPU form of the q/k norms, RoPE and index branch: one Triton launch for every head
        group, reading q/k (and the local index heads) as views of the projections' outputs.

        Returns ``(q [T, H, D], k [T, Hkv, D], extra)``, ``extra`` holding the index operands on
        sparse layers, equal to the torch path's (``forward``'s else branch and ``index_branch``).
        """
        tokens = hidden.shape[0]
        heads = [
            (q.view(tokens, self.num_heads, self.head_dim), self.q_norm),
            (k.view(tokens, self.num_kv_heads, self.head_dim), self.k_norm),
        ]
        if self.is_sparse:
            iq, _ = self.index_q_proj(hidden)
            ik, _ = self.index_k_proj(hidden)
            heads.append((iq.view(tokens, self.index_heads, self.index_head_dim)[:, self.local_index_heads], self.index_q_norm))
            heads.append((ik.view(tokens, 1, self.index_head_dim), self.index_k_norm))
        q, k, *index = norm_rope_fused(positions, self.rotary, heads)
        extra = {"index_q": index[0], "index_k": index[1].view(tokens, self.index_head_dim)} if self.is_sparse else {}
        return q, k, extra

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
        tokens = hidden.shape[0]
        qkv, _ = self.qkv_proj(hidden)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        if fused_attn_ops_on(qkv):
            q, k, extra = self.fused_norm_rope(positions, hidden, q, k)
            # The MSA backend's store reads v through its strides; dense backends get it packed.
            v = v if self.is_sparse else v.contiguous()
        else:
            q = self.q_norm(q.reshape(tokens, self.num_heads, self.head_dim))
            k = self.k_norm(k.reshape(tokens, self.num_kv_heads, self.head_dim))
            q, k = self.rotary(positions, q, k)
            v = v.contiguous()
            extra = {}
            if self.is_sparse:
                index_q, index_k = self.index_branch(positions, hidden)
                extra = {"index_q": index_q, "index_k": index_k}
        out = self.attn(q.reshape(tokens, q_size), k.reshape(tokens, kv_size), v, forward_batch, **extra)
        out, _ = self.o_proj(out)
        return out


class M3DecoderLayer(nn.Module):
    def __init__(self, spec: M3TextSpec, layer_id: int, quant_config=None, prefix: str = ""):
        super().__init__()
        self.self_attn = M3Attention(spec, layer_id, quant_config, prefix=f"{prefix}.self_attn")
        if spec.moe_layers[layer_id]:
            self.mlp = make_moe_block(spec, layer_id, quant_config, prefix=f"{prefix}.mlp")
        else:
            self.mlp = GatedMLP(
                spec, spec.dense_intermediate_size, reduce_results=True, quant_config=quant_config, prefix=f"{prefix}.mlp",
                field="dense_intermediate_size",
            )
        self.input_layernorm = M3RMSNorm(spec.hidden_size, spec.rms_norm_eps, spec.use_gemma_norm)
        self.post_attention_layernorm = M3RMSNorm(spec.hidden_size, spec.rms_norm_eps, spec.use_gemma_norm)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, forward_batch: ForwardBatch, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(mlp output, residual)``, whose sum is the layer's output (SGLang's convention): the
        residual stream is carried so that each add fuses into the norm after it (``fused_norm``).
        ``residual`` None: ``hidden`` is the stream itself (the first layer)."""
        normed, residual = add_rmsnorm(self.input_layernorm, hidden, residual)
        normed, residual = add_rmsnorm(self.post_attention_layernorm, self.self_attn(positions, normed, forward_batch), residual)
        return self.mlp(normed), residual


class M3TextModel(nn.Module):
    """The decoder stack of one pipeline stage (the whole model without pipeline parallelism):
    the embedding on the first stage, layers ``start_layer .. end_layer - 1``, the final norm on
    the last; other layers are SGLang's ``PPMissingLayer`` stand-ins."""

    def __init__(self, spec: M3TextSpec, quant_config=None, prefix: str = ""):
        super().__init__()
        self.stage: PipelineStage = pipeline_stage()
        # SGLang's multimodal routine reads this (as its group) to embed media on the first stage only.
        self.pp_group = self.stage
        self.embed_tokens = (
            VocabParallelEmbedding(spec.vocab_size, spec.hidden_size, prefix=f"{prefix}.embed_tokens")
            if self.stage.is_first_rank else PPMissingLayer()
        )
        self.layers, self.start_layer, self.end_layer = make_layers(
            spec.num_layers,
            lambda idx, prefix: M3DecoderLayer(spec, idx, quant_config, prefix=prefix),
            pp_rank=self.stage.rank, pp_size=self.stage.size, prefix=f"{prefix}.layers",
        )
        self.norm = M3RMSNorm(spec.hidden_size, spec.rms_norm_eps, spec.use_gemma_norm) if self.stage.is_last_rank else PPMissingLayer()
        #: Layers whose outputs an EAGLE3 draft reads, in the draft's order (empty: none captured).
        self.aux_layer_ids: tuple[int, ...] = ()

    def get_input_embeddings(self) -> nn.Module:
        return self.embed_tokens

    @property
    def dtype(self) -> torch.dtype:
        """The model's dtype, from a norm every stage holds (the embedding is on the first only)."""
        return self.layers[self.start_layer].input_layernorm.weight.dtype

    def forward(self, input_ids, positions, forward_batch: ForwardBatch, input_embeds=None, pp_proxy_tensors=None):
        """The final-normed hidden states; with ``aux_layer_ids`` set, also the listed layers' outputs
        (pre-norm residual stream) as ``(hidden, [aux per id])``, the form SGLang's models return.

        Pipeline stages before the last hand on ``PPProxyTensors`` of the layer output and the
        residual stream (SGLang's ``hidden_states`` / ``residual`` pair), which the next stage
        receives as ``pp_proxy_tensors``."""
        if self.stage.is_first_rank:
            hidden = self.embed_tokens(input_ids) if input_embeds is None else input_embeds
            residual = None
        else:
            hidden, residual = pp_proxy_tensors["hidden_states"], pp_proxy_tensors["residual"]
        captured: dict[int, torch.Tensor] = {}
        for layer_id in range(self.start_layer, self.end_layer):
            hidden, residual = self.layers[layer_id](positions, hidden, forward_batch, residual)
            if layer_id in self.aux_layer_ids:
                captured[layer_id] = residual + hidden  # the layer's output, as the next add forms it
        if not self.stage.is_last_rank:
            return PPProxyTensors({"hidden_states": hidden, "residual": residual})
        normed, _ = add_rmsnorm(self.norm, hidden, residual)
        if not self.aux_layer_ids:
            return normed
        return normed, [captured[i] for i in self.aux_layer_ids]


class MiniMaxM3SparseForCausalLM(nn.Module):
    """Text-only M3. Also the language half of the VL class, which adds the vision path."""

    def __init__(self, config, quant_config=None, prefix: str = ""):
        super().__init__()
        self.config = config
        self.text_config = getattr(config, "text_config", config)
        self.spec = M3TextSpec.from_config(config, getattr(config, "_name_or_path", None) or None)
        self.model = M3TextModel(self.spec, quant_config, prefix="model")
        stage = self.model.stage
        if self.spec.tie_word_embeddings and stage.size > 1:
            # the tied output layer is the first stage's embedding, which the last stage lacks
            raise ValueError(
                f"tie_word_embeddings with pipeline parallelism (--pp-size {stage.size}) is not supported: "
                "serve this checkpoint with --pp-size 1"
            )
        if not stage.is_last_rank:
            self.lm_head = PPMissingLayer()
        elif self.spec.tie_word_embeddings:
            self.lm_head = self.model.embed_tokens
        else:
            self.lm_head = ParallelLMHead(self.spec.vocab_size, self.spec.hidden_size, prefix="lm_head")
        self.logits_processor = LogitsProcessor(self.text_config)
        # SGLang's EAGLE3 worker reads this flag; set_eagle3_layers_to_capture turns it on.
        self.capture_aux_hidden_states = False
        #: whether a load has completed (a checkpoint's or the dummy loader's): a later
        #: ``load_weights`` is an update (SGLang's ``update_weights_from_tensor`` and the like),
        #: which may carry only some tensors
        self.weights_loaded = False
        if get_tensor_model_parallel_rank() == 0:
            announce_implementation(type(self))

    def get_input_embeddings(self) -> nn.Module:
        return self.model.embed_tokens

    @property
    def start_layer(self) -> int:
        """First layer of this pipeline stage (SGLang sizes the KV pool and backends by it)."""
        return self.model.start_layer

    @property
    def end_layer(self) -> int:
        return self.model.end_layer

    def get_embed_and_head(self):
        """EAGLE3 target interface: the draft shares the target's embedding (and lm head where
        its config asks for it)."""
        self._refuse_drafts_across_stages()
        return self.model.embed_tokens.weight, self.lm_head.weight

    def _refuse_drafts_across_stages(self) -> None:
        """EAGLE drafts read the target's embedding (first stage), head (last stage) and, for
        EAGLE3, layer outputs of every stage: one stage must hold them all."""
        if self.model.stage.size > 1:
            raise ValueError(
                f"speculative decoding of M3 with pipeline parallelism (--pp-size {self.model.stage.size}) is not "
                "supported: the draft reads the first stage's embedding and the last stage's head; serve it with --pp-size 1"
            )

    def set_eagle3_layers_to_capture(self, layer_ids=None) -> None:
        """EAGLE3 target interface: capture the outputs of ``layer_ids`` (the draft's
        ``eagle_aux_hidden_state_layer_ids``; None = M3's default, see ``sglang_m3.speculative.aux_layers``)."""
        self._refuse_drafts_across_stages()
        self.model.aux_layer_ids = resolve_aux_layer_ids(layer_ids, self.spec.num_layers)
        self.capture_aux_hidden_states = True

    @torch.no_grad()
    def forward(self, input_ids, positions, forward_batch: ForwardBatch, input_embeds=None, pp_proxy_tensors=None, **kwargs):
        """Logits on the last pipeline stage; the ``PPProxyTensors`` for the next stage on the others.
        (SGLang runs pipeline parallelism only for models whose ``forward`` names ``pp_proxy_tensors``.)"""
        output = self.model(input_ids, positions, forward_batch, input_embeds, pp_proxy_tensors)
        return self.logits(input_ids, output, forward_batch)

    def logits(self, input_ids, model_output, forward_batch: ForwardBatch):
        """Logits from the text model's output, handing its aux hidden states (EAGLE3) to SGLang;
        a stage before the last hands its ``PPProxyTensors`` on as they are."""
        if not self.model.stage.is_last_rank:
            return model_output
        hidden, aux = model_output if self.capture_aux_hidden_states else (model_output, None)
        return self.logits_processor(input_ids, hidden, self.lm_head, forward_batch, aux)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load the text model from original checkpoint names; see ``checkpoint_layout``. The first
        load must bring every tensor; an update (after a load) may bring some."""
        TextWeightLoader(self, whole=not self.weights_loaded).load(weights)
        self.post_load_weights()

    def post_load_weights(self) -> None:
        """Once the weights are in (SGLang's dummy loader calls this itself): every MoE block's
        router weight as 16-bit parts in the model's dtype, where they hold it exactly.

        Random weights (``--load-format dummy``) stand for the published checkpoint, which
        stores the routers in BF16: the fp32 router parameter is rounded to BF16 values first, so
        that a benchmark on dummy weights runs the router a real checkpoint gives (one 16-bit
        part), not the three parts of an fp32 weight that no published checkpoint has. Only the
        dummy fill itself: weights an update brings later (a trainer's, from random weights at
        start-up) keep their values."""
        blocks = [m for m in self.modules() if hasattr(m, "gate_half")]
        if blocks and not self.weights_loaded and weights_are_random():
            for block in blocks:
                block.gate.weight.data.copy_(block.gate.weight.data.to(PUBLISHED_ROUTER_DTYPE).float())
            logger.info("random weights: the %d MoE routers hold %s values, as in the published checkpoint", len(blocks), PUBLISHED_ROUTER_DTYPE)
        self.weights_loaded = True
        dtype = self.model.dtype
        half = sum(prepare_half_router(block, dtype) for block in blocks)
        if half:
            parts = sorted({block.gate_half.shape[0] // block.gate.out_features for block in blocks if block.gate_half is not None})
            logger.info("router logits from a %s GEMM over %s part(s) of the fp32 weight in %d of %d MoE layers",
                        dtype, "/".join(map(str, parts)), half, len(blocks))


#: the dtype of the router weights in the published M3 checkpoints (BF16 and MXFP8 alike)
PUBLISHED_ROUTER_DTYPE = torch.bfloat16


def weights_are_random() -> bool:
    """Whether SGLang fills the weights at random (``--load-format dummy``) instead of reading a
    checkpoint; False outside a server (no published load format)."""
    from sglang.srt.runtime_context import get_model

    try:
        load_format = get_model().load_format
    except ValueError:  # the runtime context is not published: a model built outside a server
        return False
    return str(getattr(load_format, "value", load_format)) == "dummy"


def mxfp8_expert_layers(model: nn.Module) -> frozenset[int]:
    """Layers whose MoE block keeps the routed experts in MXFP8 (takes weight/scale pairs as is)."""
    return frozenset(m.layer_id for m in model.modules() if getattr(m, "holds_mxfp8_experts", False))


def announce_implementation(model_class: type) -> None:
    """Log once per server (tensor-parallel rank 0, at model build) which classes serve M3.

    SGLang can skip this plugin without an error (see dists/sglang-m3-cpu-platform) and then
    upstream's classes serve under the same architecture names; this line is how a server log
    shows which implementation is in use.
    """
    logger.info("sglang-m3 %s serves %s (%s)", version("sglang-m3"), model_class.__name__, model_class.__module__)


#: why the loader skips a checkpoint tensor -> the line it logs once, with the count
SKIPPED = {
    # Some exporters keep the tied output layer's copy; transformers and SGLang's own loaders tie
    # it to the embedding and never read it.
    "tied_head": "skipped lm_head.weight: tie_word_embeddings is true, so the output layer is the input embedding (%d tensor(s))",
    "rotary": "skipped %d rotary buffer(s) (rotary_emb.*): the model computes them from the config",
    "mtp": "skipped %d multi-token-prediction tensor(s) (mtp.*): not used until speculative decoding reads them",
    "other_stage": "skipped %d tensor(s) of the layers, embedding, norm or head other pipeline stages hold",
}

#: a decoder layer's index in a checkpoint tensor name (text or VL spelling)
_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")


class TextWeightLoader:
    """Routes checkpoint tensors into the sharded parameters, checking names and shapes."""

    def __init__(self, model: MiniMaxM3SparseForCausalLM, whole: bool = True):
        """``whole``: the stream must bring every tensor of the model (a load, not an update)."""
        self.model = model
        self.whole = whole
        self.spec = model.spec
        self.stage = model.model.stage
        self.layers = range(model.model.start_layer, model.model.end_layer)
        #: every tensor of the model (names and shapes are checked against it on every stage) ...
        self.known = expected_text_tensors(model.spec)
        #: ... and those this pipeline stage holds (all of them without pipeline parallelism)
        self.expected = {name: shape for name, shape in self.known.items() if self.holds(name)}
        self.params = dict(model.named_parameters())
        self.seen: set[str] = set()
        #: tensors read but not loaded, by reason (a key of ``SKIPPED``)
        self.skipped: Counter[str] = Counter()
        self.mxfp8_expert_layers = mxfp8_expert_layers(model)
        # An MXFP8 checkpoint's weight/scale pairs become plain weights here (dequantize at load),
        # but for the modules whose parameters stay MXFP8 (keeps_quantized).
        self.dequantizer = MXFP8Dequantizer(self.spec.quantization, self.keeps_quantized) if self.spec.quantization else None

    def holds(self, name: str) -> bool:
        """Whether this pipeline stage holds tensor ``name`` (a canonical or checkpoint name): its
        layers', the embedding on the first stage, the final norm and output layer on the last."""
        layer = _LAYER_INDEX.search(name)
        if layer is not None:
            return int(layer.group(1)) in self.layers
        if name.endswith("embed_tokens.weight"):
            return self.stage.is_first_rank
        return self.stage.is_last_rank

    def load(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in weights:
            self.load_one(name, tensor)
        self.finish()

    def load_one(self, checkpoint_name: str, tensor: torch.Tensor) -> None:
        if checkpoint_name.startswith(IGNORED_PREFIXES):
            self.skipped["mtp"] += 1
            return
        if is_derived_buffer(checkpoint_name):
            self.skipped["rotary"] += 1
            return
        layer = _LAYER_INDEX.search(checkpoint_name)
        if layer is not None and int(layer.group(1)) < self.spec.num_layers and int(layer.group(1)) not in self.layers:
            # before an MXFP8 pair is dequantized: the stage holding that layer loads (and checks) it
            self.skipped["other_stage"] += 1
            return
        if self.dequantizer is None:
            refuse_quantized_tensor(checkpoint_name, tensor)
        else:
            plain = self.dequantizer.push(checkpoint_name, tensor)
            if plain is None:
                return  # the other half of an MXFP8 pair is still due
            checkpoint_name, tensor = plain
        name = text_tensor_name(checkpoint_name)
        if name is None:
            raise CheckpointError(f"checkpoint tensor '{checkpoint_name}' is not part of the M3 text model")
        if name == "lm_head.weight" and self.spec.tie_word_embeddings:
            self.skipped["tied_head"] += 1
            return
        name = canonical_dense_mlp_name(name, self.spec)
        if name not in self.known:
            raise CheckpointError(f"checkpoint tensor '{checkpoint_name}' is not part of this M3 configuration")
        if tuple(tensor.shape) != self.known[name]:
            raise CheckpointError(
                f"checkpoint tensor '{checkpoint_name}' has shape {tuple(tensor.shape)}, expected {self.known[name]}"
            )
        if name not in self.expected:
            self.skipped["other_stage"] += 1
            return
        if isinstance(tensor, torch.Tensor) and not tensor.is_floating_point():
            # Loading would cast it to the parameter's dtype: integers read as weights are garbage.
            raise CheckpointError(
                f"checkpoint tensor '{checkpoint_name}' is {tensor.dtype}: M3's weights are floating point "
                "(bf16, fp16 or fp32; 8-bit only as an MXFP8 checkpoint declares it)"
            )
        if name in self.seen:
            # Two tensors for one weight (stored twice, or a dense MLP under both the ``mlp.`` and
            # the ``block_sparse_moe.`` spelling): whichever came last would win, silently.
            raise CheckpointError(
                f"checkpoint tensor '{checkpoint_name}' loads into '{name}', which an earlier tensor "
                "already loaded: the checkpoint stores this weight twice"
            )
        self.seen.add(name)
        self._copy(name, tensor)

    def keeps_quantized(self, module: str) -> bool:
        """Whether checkpoint module ``module``'s MXFP8 pair loads as it is: a routed expert of a
        block that keeps MXFP8 experts, or a linear whose weight parameter is float8 (built so on
        CUDA, ``sglang_m3.quant.mxfp8_linear``)."""
        expert = ROUTED_EXPERT.search(module)
        if expert is not None:
            return int(expert.group(1)) in self.mxfp8_expert_layers
        name = text_tensor_name(f"{module}.weight")
        if name is None:
            return False
        param = self.params.get(self._target(canonical_dense_mlp_name(name, self.spec))[0])
        return param is not None and param.dtype == WEIGHT_DTYPE

    @staticmethod
    def _target(name: str) -> tuple[str, str | int | None]:
        """(model parameter, shard id or None) that canonical checkpoint tensor ``name`` loads into."""
        _, _, suffix = name.partition(".layers.")
        if not suffix:
            return name, None
        layer_no, _, local = suffix.partition(".")
        prefix = f"model.layers.{layer_no}."
        if local in PACKED:
            target, shard = PACKED[local]
            return prefix + target, shard
        return prefix + RENAMED.get(local, local), None

    def _copy(self, name: str, tensor: torch.Tensor) -> None:
        expert = _EXPERT.match(name)
        if expert:
            self.model.get_submodule(f"{expert.group(1)}.mlp").load_expert_weight(int(expert.group(2)), expert.group(3), tensor)
            return
        shared = _SHARED_EXPERT.match(name)
        if shared:
            block = self.model.get_submodule(f"{shared.group(1)}.mlp")
            if getattr(block, "shared_slot", None) is not None:  # held by the fused layer (fused_moe)
                block.load_shared_weight(shared.group(2), tensor)
                return
        target, shard = self._target(name)
        # an MXFP8 linear's weight and its scale load alike (same rows, input columns / 32)
        parts = {target: tensor.elements, f"{target}_scale_inv": tensor.scales} if isinstance(tensor, MXFP8Weight) else {target: tensor}
        for param_name, value in parts.items():
            param = self.params[param_name]
            if shard is None:
                getattr(param, "weight_loader", default_weight_loader)(param, value)
            else:
                param.weight_loader(param, value, shard)

    def finish(self) -> None:
        if self.dequantizer is not None:
            self.dequantizer.finish()
            kept = self.dequantizer
            logger.info(
                "dequantized %d MXFP8 weight(s) at load, kept %d routed-expert and %d linear weight(s) in MXFP8",
                kept.dequantized, kept.kept_experts, kept.kept_quantized - kept.kept_experts,
            )
        for reason, count in self.skipped.items():
            logger.info(SKIPPED[reason], count)
        missing = sorted(set(self.expected) - self.seen) if self.whole else []
        if missing:
            shown = ", ".join(map(missing_tensor_spellings, missing[:5])) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
            raise CheckpointError(f"checkpoint is missing {len(missing)} tensor(s): {shown}")


EntryClass = [MiniMaxM3SparseForCausalLM]
