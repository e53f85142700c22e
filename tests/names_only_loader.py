"""The checkpoint loader's name and shape checks without a model to copy into."""

from __future__ import annotations

from types import SimpleNamespace

from torch import nn

from sglang_m3.models.minimax_m3 import TextWeightLoader
from sglang_m3.models.pipeline import PipelineStage


def whole_model_stage(spec) -> SimpleNamespace:
    """What the loader reads of a text model's pipeline stage, for a model without pipeline
    parallelism: one stage holding every layer."""
    return SimpleNamespace(stage=PipelineStage(), start_layer=0, end_layer=spec.num_layers)


class NamesOnlyLoader(TextWeightLoader):
    """``TextWeightLoader`` over a bare module holding ``spec``: every check, no copies."""

    def __init__(self, spec):
        holder = nn.Module()
        holder.spec = spec
        holder.model = whole_model_stage(spec)
        super().__init__(holder)

    def _copy(self, name, tensor):
        pass
