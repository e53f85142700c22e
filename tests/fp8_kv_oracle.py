"""transformers' M3 with its main K/V rounded through float8_e4m3fn: the independent oracle of an fp8 KV cache.

SGLang's fp8 KV pool stores ``k.to(float8_e4m3fn)`` (scale 1.0 for a checkpoint without KV scales)
and attention reads those values back; the index keys are not quantized. Rounding the keys and
values that transformers' attention receives (after the norms and RoPE, the point where SGLang
writes its cache) does the same to an implementation that shares no code with the server. The
rounding is idempotent, so keys re-read from transformers' cache at every decode step round to
the same values. The indexer computes its own keys and is left as it is.
"""

from __future__ import annotations

import contextlib

import torch
from transformers_oracle import greedy_tokens, load_reference_model, prompt_logprobs

FP8_KV_DTYPE = torch.float8_e4m3fn


@contextlib.contextmanager
def e4m3_kv_attention(model_dir: str):
    """Within the block, the oracle model's attention function sees K/V rounded to e4m3 (then widened)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    implementation = load_reference_model(model_dir).config.get_text_config()._attn_implementation
    if implementation not in ALL_ATTENTION_FUNCTIONS:
        raise RuntimeError(f"the oracle attends with {implementation!r}, which ALL_ATTENTION_FUNCTIONS cannot override")
    original = ALL_ATTENTION_FUNCTIONS[implementation]

    def rounded(module, query, key, value, *args, **kwargs):
        key = key.to(FP8_KV_DTYPE).to(key.dtype)
        value = value.to(FP8_KV_DTYPE).to(value.dtype)
        return original(module, query, key, value, *args, **kwargs)

    ALL_ATTENTION_FUNCTIONS[implementation] = rounded
    try:
        yield
    finally:
        ALL_ATTENTION_FUNCTIONS[implementation] = original


def e4m3_prompt_logprobs(model_dir: str, prompt_ids: list[int]) -> torch.Tensor:
    with e4m3_kv_attention(model_dir):
        return prompt_logprobs(model_dir, prompt_ids)


def e4m3_greedy_tokens(model_dir: str, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    with e4m3_kv_attention(model_dir):
        return greedy_tokens(model_dir, prompt_ids, max_new_tokens)
