"""Tiny EAGLE3 drafts for the tiny M3 and the speculative server flags the tests share."""

from __future__ import annotations

import pytest

#: A chain of 3 drafts verified as 4 tokens (the issue's chain configuration).
CHAIN_FLAGS = (
    "--speculative-algorithm", "EAGLE3",
    "--speculative-num-steps", "3", "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4",
)
#: A chain of 7 drafts verified as 8 tokens: the shape a draft accepted as often as the
#: lm-head-copy one would run with, and verify rows past a chain of 3's.
LONG_CHAIN_FLAGS = (
    "--speculative-algorithm", "EAGLE3",
    "--speculative-num-steps", "7", "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "8",
)
#: A tree: top-3 drafts per step over 3 steps, the best 8 tokens (root included) verified.
TREE_FLAGS = (
    "--speculative-algorithm", "EAGLE3",
    "--speculative-num-steps", "3", "--speculative-eagle-topk", "3", "--speculative-num-draft-tokens", "8",
)


@pytest.fixture(scope="session")
def tiny_draft_factory(tiny_m3_checkpoint, tmp_path_factory):
    """``factory(copy_target_lm_head=False, draft_vocab_size=None, aux_layer_ids=None)`` -> draft dir (built once per variant)."""
    from sglang_m3.speculative.tiny_draft import build_tiny_draft

    built: dict[tuple, str] = {}

    def factory(copy_target_lm_head: bool = False, draft_vocab_size: int | None = None, aux_layer_ids=None) -> str:
        key = (copy_target_lm_head, draft_vocab_size, tuple(aux_layer_ids or ()))
        if key not in built:
            out = tmp_path_factory.mktemp("tiny-draft")
            built[key] = build_tiny_draft(
                tiny_m3_checkpoint, str(out), copy_target_lm_head=copy_target_lm_head,
                draft_vocab_size=draft_vocab_size, aux_layer_ids=aux_layer_ids,
            )
        return built[key]

    return factory
