"""transformers' own MiniMax M3 (``minimax_m3_vl``) as the independent oracle for model outputs."""

from __future__ import annotations

import functools
import random

import torch


@functools.lru_cache(maxsize=8)
def load_reference_model(model_dir: str):
    from transformers.models.minimax_m3_vl import MiniMaxM3SparseForConditionalGeneration

    # A text-only checkpoint has no vision tensors; transformers initialises that (unused) part.
    return MiniMaxM3SparseForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()


@torch.no_grad()
def greedy_tokens(model_dir: str, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    model = load_reference_model(model_dir)
    out = model.generate(input_ids=torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt_ids) :].tolist()


@torch.no_grad()
def prompt_logprobs(model_dir: str, prompt_ids: list[int]) -> torch.Tensor:
    """Log-probability of every prompt token after the first, given its prefix."""
    logits = load_reference_model(model_dir)(input_ids=torch.tensor([prompt_ids])).logits[0].float()
    return logits[:-1].log_softmax(-1).gather(1, torch.tensor(prompt_ids[1:])[:, None])[:, 0]


def random_prompt(seed: int, length: int, low: int = 20, high: int = 500) -> list[int]:
    """Token ids drawn from the ordinary (non-special) part of the tiny vocabulary."""
    rng = random.Random(seed)
    return [rng.randrange(low, high) for _ in range(length)]
