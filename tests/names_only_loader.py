"""The checkpoint loader's name and shape checks without a model to copy into."""

from __future__ import annotations

from torch import nn

from sglang_m3.models.minimax_m3 import TextWeightLoader


class NamesOnlyLoader(TextWeightLoader):
    """``TextWeightLoader`` over a bare module holding ``spec``: every check, no copies."""

    def __init__(self, spec):
        holder = nn.Module()
        holder.spec = spec
        super().__init__(holder)

    def _copy(self, name, tensor):
        pass
