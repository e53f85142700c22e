"""This process's pipeline-parallel stage, as the M3 classes build themselves for it.

Inside a server SGLang writes the pipeline group into its runtime context before it builds the
model, and ``--pp-size`` N splits M3's layers over N stages (SGLang's ``get_pp_indices``). A model
built outside a server that stated only its tensor-parallel place (the tests, the ``inspect``
command's loader) is the whole pipeline: one stage.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PipelineStage:
    """Rank and size of this process's pipeline group. ``is_first_rank`` / ``is_last_rank`` carry
    the names of SGLang's group, which its multimodal routine reads from a language model's
    ``pp_group`` to embed media on the first stage only."""

    rank: int = 0
    size: int = 1

    @property
    def is_first_rank(self) -> bool:
        return self.rank == 0

    @property
    def is_last_rank(self) -> bool:
        return self.rank == self.size - 1


def pipeline_stage() -> PipelineStage:
    """This process's stage: SGLang's pipeline group where it was written, else the one stage."""
    from sglang.srt.runtime_context import get_parallel

    try:
        group = get_parallel().pp_group
    except RuntimeError:  # not written in this process: a model built outside a server
        return PipelineStage()
    return PipelineStage(rank=group.rank_in_group, size=group.world_size)
