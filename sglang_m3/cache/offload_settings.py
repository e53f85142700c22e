"""The sparse-offload switch and the server settings it cannot run with.

Sparse offload keeps the main K/V of every sparse layer in a host store and serves decode /
verify from a per-layer device block cache (:mod:`sglang_m3.cache.offload_pool`;
:mod:`sglang_m3.msa.offload_backend` on the CPU platform, :mod:`sglang_m3.msa.offload_triton_backend`
on CUDA). Like the project's other serving switches it is an
environment variable (SGLang's server arguments cannot be extended by a plugin), which a recipe
sets from ``spec.hostOffload`` (``mode: sparse-offload``, ``cacheBlocks``; the renderer owns the name):
``SGLANG_M3_SPARSE_OFFLOAD_BLOCKS=N`` turns it on with N cache entries (one MSA block each) per
sparse layer; unset or 0 keeps every K/V on the device. Its host budget is
:mod:`sglang_m3.cache.offload_budget`'s. ``SGLANG_M3_SPARSE_OFFLOAD_LOG_STEPS``
sets how many decode / verify steps pass between two log lines of the cache's counters.

Every incompatible setting is refused at start-up by its flag's name (:func:`check_sparse_offload`).
"""

from __future__ import annotations

from dataclasses import dataclass

from sglang_m3.env_switch import env_non_negative_int
from sglang_m3.recipe.render import SPARSE_OFFLOAD_BLOCKS_ENV, sparse_offload_selection_blocks

SPARSE_OFFLOAD_LOG_STEPS_ENV = "SGLANG_M3_SPARSE_OFFLOAD_LOG_STEPS"
DEFAULT_LOG_STEPS = 100


def sparse_offload_blocks() -> int:
    """Block-cache entries per sparse layer; 0 when sparse offload is off."""
    return env_non_negative_int(SPARSE_OFFLOAD_BLOCKS_ENV, 0)


def offload_log_steps() -> int:
    """Decode / verify steps between two counter log lines (0: never log)."""
    return env_non_negative_int(SPARSE_OFFLOAD_LOG_STEPS_ENV, DEFAULT_LOG_STEPS)


@dataclass(frozen=True)
class OffloadShape:
    """What sizes the block cache: its entries and what one request of the server can select."""

    cache_blocks: int
    block_size: int
    topk: int
    kv_heads: int  # per rank
    max_query_tokens: int  # per request and step: 1, or the speculative draft tokens

    @property
    def pages_per_request(self) -> int:
        """Distinct pages one request can need in one step: every query token's top-k per KV head."""
        return sparse_offload_selection_blocks(self.max_query_tokens, self.kv_heads, self.topk)

    @property
    def requests_per_round(self) -> int:
        """Requests whose fetches and attention share the cache at once (the batch runs in rounds)."""
        return self.cache_blocks // self.pages_per_request


def max_query_tokens(server_args) -> int:
    """Query tokens per request of a decode or verify step under these server arguments.

    Under ``--speculative-adaptive`` the worker switches between chains of each candidate length
    while serving (SGLang's candidates, from ``--speculative-adaptive-config`` or its defaults),
    verifying steps + 1 tokens per request; the block cache's rounds are sized once at start-up,
    so they are sized for the longest candidate, and a shorter chain fills a round partly."""
    if getattr(server_args, "speculative_algorithm", None) is None:
        return 1
    tokens = max(1, int(getattr(server_args, "speculative_num_draft_tokens", None) or 1))
    if getattr(server_args, "speculative_adaptive", False):
        from sglang.srt.speculative.adaptive_spec_params import resolve_candidate_steps_from_config

        candidates = resolve_candidate_steps_from_config(getattr(server_args, "speculative_adaptive_config", None))
        tokens = max(tokens, max(candidates) + 1)
    return tokens


#: Devices sparse offload serves on: the CPU platform's torch path, CUDA's Triton path.
OFFLOAD_DEVICES = ("cpu", "cuda")


def _is_rocm() -> bool:
    import torch

    return getattr(torch.version, "hip", None) is not None


def check_sparse_offload(shape: OffloadShape, server_args, device: str, page_size: int) -> None:
    """Refuse, naming the setting, what sparse offload cannot serve (yet)."""
    blocks = f"{SPARSE_OFFLOAD_BLOCKS_ENV}={shape.cache_blocks}"
    kind = str(device).split(":")[0]
    if kind not in OFFLOAD_DEVICES or (kind == "cuda" and _is_rocm()):
        raise ValueError(
            f"{blocks}: sparse offload runs on the CPU platform (torch path) and on NVIDIA CUDA (the MSA Triton path "
            f"reading a page-locked host store, not verified on ROCm); unset {SPARSE_OFFLOAD_BLOCKS_ENV} on {device}")
    if page_size != shape.block_size:
        raise ValueError(
            f"{blocks} needs --page-size {shape.block_size} (the MSA block size): the host store is "
            f"fetched a whole page per selected block; got --page-size {page_size}")
    if getattr(server_args, "enable_hierarchical_cache", False):
        raise ValueError(f"{blocks} cannot be combined with --enable-hierarchical-cache yet: its loads "
                         "write the host store behind the block cache")
    if getattr(server_args, "enable_hisparse", False):
        raise ValueError(f"{blocks} replaces --enable-hisparse (upstream's sparse offload): pass one of them")
    if (getattr(server_args, "pp_size", None) or 1) > 1:
        raise ValueError(f"{blocks} cannot run with --pp-size > 1 yet: stages would size different host stores")
    if (getattr(server_args, "speculative_eagle_topk", None) or 1) > 1:
        raise ValueError(f"{blocks} serves speculative chains only (a draft tree's attention reads each draft "
                         "from its pool slot, which lives in the host store): run with --speculative-eagle-topk 1")
    if shape.requests_per_round < 1:
        raise ValueError(
            f"{blocks} is smaller than one request's selection: {shape.max_query_tokens} query token(s)"
            f"{' (the longest adaptive chain verifies that many)' if getattr(server_args, 'speculative_adaptive', False) else ''} x "
            f"{shape.kv_heads} KV heads x top-{shape.topk} = {shape.pages_per_request} blocks per step; "
            f"set {SPARSE_OFFLOAD_BLOCKS_ENV} to at least {shape.pages_per_request}")
