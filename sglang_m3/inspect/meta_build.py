"""Builds the project's M3 model for one tensor-parallel rank on the meta device.

SGLang's parallel layers take their split from the runtime context (``get_parallel()``), and
SGLang can build that context for any rank of any layout without a process group: a
``ServerArgs`` for the layout and ``create_context(..., ranks=SpawnRanks(world_rank=r))``.
The layers then own their partition through SGLang's logical groups ("own a weight partition
before distributed communication is initialized"). The project's model also asks for the TP
group's size and rank directly, so that group is stated for the build as a construction-only
group: rank and size, no communicator (construction never communicates). The config is handed
to SGLang and the model from a temporary directory, exactly as read by ``source``. SGLang's
notes about serving on this machine are silenced while it is imported and while a rank's context
resolves the server arguments (``quiet``): inspect serves nothing, its user sees only the report.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from dataclasses import dataclass

from sglang_m3.config import M3ConfigError, vision_part
from sglang_m3.inspect.quiet import sglang_noise_silenced
from sglang_m3.inspect.sharding import ShardedParam, sort_parameters

BUILD_DTYPE_NAME = "bfloat16"


@dataclass(frozen=True)
class _ConstructionGroup:
    """The TP group as a model constructor sees it: rank and size, nothing to communicate over."""

    rank_in_group: int
    world_size: int
    cpu_group: None = None


@dataclass(frozen=True)
class RankBuild:
    """One rank's parameters and KV cache cell, as the built model holds them."""

    rank: int
    params: list[ShardedParam]
    #: K and V of every layer, bytes per token on this rank
    kv_bytes_per_token: int
    #: the index key of every sparse layer, bytes per token on this rank
    index_bytes_per_token: int
    kv_heads_per_rank: int


@contextlib.contextmanager
def layout(top: dict, tp: int, ep: int):
    """Yields ``build(rank) -> RankBuild`` for the ``tp`` x ``ep`` layout of config ``top``."""
    with sglang_noise_silenced():  # the model modules import SGLang
        _check_vision(top)
        model_class = _model_class(top)
    with tempfile.TemporaryDirectory(prefix="sglang-m3-inspect-") as directory:
        with open(os.path.join(directory, "config.json"), "w", encoding="utf-8") as handle:
            json.dump(top, handle)
        server_args = _server_args(directory, tp, ep)
        config = _model_config(directory)
        yield lambda rank: _build_rank(server_args, model_class, config, tp, rank)


def _server_args(directory: str, tp: int, ep: int):
    from sglang.srt.server_args import ServerArgs

    return ServerArgs(model_path=directory, tp_size=tp, ep_size=ep, device="cpu", dtype=BUILD_DTYPE_NAME)


VL_ARCHITECTURE = "MiniMaxM3SparseForConditionalGeneration"
TEXT_ARCHITECTURE = "MiniMaxM3SparseForCausalLM"


def architecture_of(top: dict) -> str:
    """The class SGLang would serve: the config's ``architectures`` entry (a text-only checkpoint
    saved through transformers' VL config still carries a ``vision_config`` but no vision
    tensors), or the VL class where a config names none and has a ``vision_config``."""
    named = [name for name in top.get("architectures") or () if name in (VL_ARCHITECTURE, TEXT_ARCHITECTURE)]
    if named:
        return named[0]
    if top.get("architectures"):
        raise M3ConfigError(
            f"config field 'architectures' ({top['architectures']!r}) names no M3 class: "
            f"{TEXT_ARCHITECTURE} or {VL_ARCHITECTURE}"
        )
    return VL_ARCHITECTURE if vision_part(top) is not None else TEXT_ARCHITECTURE


def _model_class(top: dict):
    if architecture_of(top) == VL_ARCHITECTURE:
        from sglang_m3.models.minimax_m3_vl import MiniMaxM3SparseForConditionalGeneration

        return MiniMaxM3SparseForConditionalGeneration
    from sglang_m3.models.minimax_m3 import MiniMaxM3SparseForCausalLM

    return MiniMaxM3SparseForCausalLM


def _model_config(directory: str):
    """The config object the server hands the model (the model re-reads the file it came from)."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(directory)


def _check_vision(top: dict) -> None:
    """The vision tower's sizes, refused like the config package refuses text fields."""
    if architecture_of(top) != VL_ARCHITECTURE:
        return
    from sglang_m3.models.vision import VisionDims

    try:
        VisionDims.from_config(top)
    except ValueError as error:
        raise M3ConfigError(str(error)) from None


def _build_rank(server_args, model_class, config, tp: int, rank: int) -> RankBuild:
    import torch
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.runtime_context import SpawnRanks, create_context, use_context

    with sglang_noise_silenced():  # resolves the server arguments, logging serving choices
        context = create_context(server_args, role="scheduler", ranks=SpawnRanks(world_rank=rank))
    parallel = context.parallel
    previous_dtype = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, BUILD_DTYPE_NAME))
    try:
        with use_context(context), parallel.override(tp_group=_ConstructionGroup(rank, tp)), torch.device("meta"):
            model = model_class(config)
            params = sort_parameters(model)
    finally:
        torch.set_default_dtype(previous_dtype)
    element = torch.finfo(getattr(torch, BUILD_DTYPE_NAME)).bits // 8
    attentions = [m for m in model.modules() if isinstance(m, RadixAttention)]
    kv = sum(a.tp_k_head_num * a.qk_head_dim + a.tp_v_head_num * a.v_head_dim for a in attentions) * element
    index = sum(layer.self_attn.index_head_dim for layer in model.model.layers if layer.self_attn.is_sparse) * element
    return RankBuild(rank, params, kv, index, max(a.tp_k_head_num for a in attentions))
