"""Sorts every parameter of a built rank under the rule that splits it across ranks.

The rule is read off the SGLang layer class that owns the parameter (what SGLang itself does
with it), never off a name list, so a layer swapped in the model is sorted by what it is:

* ``attention_tp``: query rows of ``QKVParallelLinear`` and the attention ``o_proj``
  (column- / row-parallel): split over the attention TP ranks;
* ``kv_heads``: key and value rows of ``QKVParallelLinear``: split over min(tp,
  num_key_value_heads) ranks, each KV head replicated on tp / num_key_value_heads ranks beyond;
* ``tp``: the other column- / row-parallel linears (dense MLP, shared expert) and the
  vocab-parallel embedding and lm_head: split over TP;
* ``experts``: routed experts: num_experts / ep experts per rank, each expert's intermediate
  split over tp / ep (SGLang's FusedMoE); with ep dividing tp that is 1/tp of them either way;
* ``replicated``: everything else, whole on every rank: norms, the index q/k projections
  (``ReplicatedLinear``), the router and its correction bias (fp32), the vision tower.

Each parameter also gets its pipeline place: its layer index, ``first`` (embedding, vision
tower) or ``last`` (final norm, lm_head).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

GROUPS = ("attention_tp", "kv_heads", "tp", "experts", "replicated")

GROUP_RULES = {
    "attention_tp": "q rows of qkv_proj and o_proj: column-/row-parallel, split over attention TP",
    "kv_heads": "k/v rows of qkv_proj: split over min(tp, num_key_value_heads) ranks, each KV head "
                "replicated on tp/num_key_value_heads ranks beyond",
    "tp": "dense MLP and shared expert (gate_up column-, down row-parallel), embedding and lm_head "
          "(vocab-parallel): split over TP",
    "experts": "routed experts: num_experts/ep per rank, intermediate split over tp/ep (SGLang "
               "FusedMoE)",
    "replicated": "whole on every rank: norms, index q/k projections, router + correction bias "
                  "(fp32), vision tower",
}

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


@dataclass(frozen=True)
class ShardedParam:
    """One parameter (or one part of a packed one) as a rank holds it."""

    name: str
    shape: tuple[int, ...]
    dtype_bytes: int
    group: str
    place: int | str

    @property
    def numel(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype_bytes


def place_of(name: str) -> int | str:
    layer = _LAYER.match(name)
    if layer:
        return int(layer.group(1))
    return "last" if name.startswith(("lm_head.", "model.norm.")) else "first"


def sort_parameters(model) -> list[ShardedParam]:
    """Every parameter of ``model`` (built for one rank) with its group, place and this rank's shape.

    The project's torch MoE block and SGLang's FusedMoE split the routed experts alike, so either
    block's parameters already have the rank's shapes.
    """
    from sglang.srt.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
    from sglang.srt.layers.vocab_parallel_embedding import VocabParallelEmbedding

    from sglang_m3.models.moe import M3SparseMoeBlock

    sorted_params: list[ShardedParam] = []
    for module_name, module in model.named_modules():
        for param_name, param in module.named_parameters(recurse=False):
            name = f"{module_name}.{param_name}" if module_name else param_name
            shape, size = tuple(param.shape), param.element_size()
            place = place_of(name)
            if isinstance(module, QKVParallelLinear):
                q_rows = module.num_heads * module.head_size
                kv_rows = shape[0] - q_rows
                sorted_params.append(ShardedParam(name + "[q]", (q_rows, *shape[1:]), size, "attention_tp", place))
                sorted_params.append(ShardedParam(name + "[kv]", (kv_rows, *shape[1:]), size, "kv_heads", place))
                continue
            if isinstance(module, M3SparseMoeBlock) and param_name in ("w13", "w2") or _is_fused_moe(module):
                group = "experts"
            elif isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
                group = "attention_tp" if ".self_attn." in f".{name}" else "tp"
            elif isinstance(module, VocabParallelEmbedding):
                group = "tp"
            else:
                group = "replicated"
            sorted_params.append(ShardedParam(name, shape, size, group, place))
    return sorted_params


def _is_fused_moe(module) -> bool:
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE

    return isinstance(module, FusedMoE)
