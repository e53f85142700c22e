"""``--warmups m3_long_prompt``: one long prompt before the server listens, on CUDA.

SGLang's own start-up request is a few tokens, which M3 attends densely (every block selected),
and its CUDA-graph capture covers decode and short prefill. So the sparse layers' prefill kernels
(index scan and top-k, the split merge after a prefix, block-major attention) and the dense
layer's plans for chunks after a prefix first compiled at a user's first long prompt: 2.5 s for
the first 32K prompt on an H200 with an empty Triton cache, against 0.4 s once compiled
(``benchmarks/results/cold_start_h200/``); with this warm-up, 407 ms, for 6.2 s more start-up.
Since then the backends' construction compiles the extend kernels (``msa_kernels.prepare``) and
builds the full chunks' plans (``dense_prefill.prebuild_chunk_plans``) on every CUDA server; this
warm-up still runs what those leave out, such as a prompt's partial last chunk.
This warm-up sends, before the server takes requests (SGLang runs ``--warmups`` in the HTTP
server's start-up), one prompt of two full prefill chunks and half of a third: a first chunk, a
full chunk after a prefix and a partial one, the shapes a long prompt runs. It then empties the
radix cache of the warm-up's tokens. It does nothing for other models, off CUDA, or in
prefill/decode disaggregation (where a request needs a peer).
"""

from __future__ import annotations

import logging
import time

logger = logging.getLogger(__name__)

NAME = "m3_long_prompt"
#: prompt length where chunked prefill is off: long enough for sparse selection (M3 selects every
#: block up to 16 blocks of 128 tokens), as one extend
UNCHUNKED_TOKENS = 16384


def warmup_prompt_tokens(chunked_prefill_size: int | None, context_len: int) -> int:
    """Two full chunks and half of a third, within the context (SGLang refuses a prompt of
    ``context_len`` tokens or more, and the request needs room for its one output token)."""
    chunk = chunked_prefill_size if chunked_prefill_size and chunked_prefill_size > 0 else None
    wanted = 2 * chunk + chunk // 2 if chunk else UNCHUNKED_TOKENS
    return max(1, min(wanted, context_len - 2))


def why_skipped(hf_config, device: str | None, disaggregation_mode: str) -> str | None:
    """Why this server runs no warm-up, or None when it does."""
    from sglang_m3.integration.hooks import is_m3

    if not is_m3(hf_config):
        return "not an M3 model"
    if device != "cuda":
        return f"device {device!r} (its kernels are not compiled per shape)"
    if disaggregation_mode != "null":
        return f"disaggregation mode {disaggregation_mode!r}"
    return None


def server_settings() -> tuple[str | None, int | None]:
    """``(device, chunked_prefill_size)`` as this SGLang process resolved them (its runtime context:
    the HTTP server's copy of the server arguments leaves ``device`` unset)."""
    from sglang.srt.runtime_context import get_device, get_schedule

    return get_device().device, get_schedule().chunked_prefill_size


#: ids below this are ordinary text tokens in M3's tokenizer (its special ids, image and video
#: placeholders among them, sit at 200000 and above), so the prompt never asks for media
ORDINARY_IDS = 200000


def warmup_token_ids(length: int, vocab_size: int) -> list[int]:
    """Deterministic ordinary ids (what they say does not matter; their count does)."""
    span = min(vocab_size, ORDINARY_IDS)
    return [(7919 * i + 13) % span for i in range(length)]


async def long_prompt_warmup(disaggregation_mode: str, tokenizer_manager) -> None:
    """The registered warm-up (SGLang calls it with these two arguments)."""
    from sglang.srt.managers.io_struct import GenerateReqInput

    device, chunk = server_settings()
    reason = why_skipped(tokenizer_manager.model_config.hf_config, device, disaggregation_mode)
    if reason is not None:
        logger.info("sglang-m3: %s warm-up skipped: %s", NAME, reason)
        return
    length = warmup_prompt_tokens(chunk, tokenizer_manager.context_len)
    ids = warmup_token_ids(length, tokenizer_manager.model_config.vocab_size)
    began = time.perf_counter()
    request = GenerateReqInput(input_ids=ids, sampling_params={"max_new_tokens": 1, "temperature": 0})
    async for _ in tokenizer_manager.generate_request(request, None):
        pass
    flushed = await tokenizer_manager.flush_cache()
    logger.info(
        "sglang-m3: %s warm-up prefilled %d tokens in %.2f s (radix cache emptied: %s)",
        NAME, length, time.perf_counter() - began, getattr(flushed, "success", flushed),
    )


def register_long_prompt_warmup() -> None:
    """Make ``--warmups m3_long_prompt`` known to SGLang (its registry of named start-up warm-ups)."""
    from sglang.srt.entrypoints.warmup import warmup

    warmup(NAME)(long_prompt_warmup)
