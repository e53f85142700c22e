"""Prefill of M3's dense layers through torch's fused attention (cuDNN, FlashAttention; the CPU's SDPA).

M3's first layers attend every earlier token. In a long prompt they dominate prefill: measured on
the H100 at M3 shapes (64 query heads over 4 KV heads, head dim 128, bf16; 8K-token chunks of a
128K prompt, ``benchmarks/dense_prefill.py``), SGLang's Triton extend kernel takes 2,078 ms per
dense layer, SDPA with FlashAttention 819 ms and with cuDNN 1,077 ms; on a chunk without cached
prefix cuDNN is fastest (1.9 ms against 3.3 ms for FlashAttention and 5.7 ms for Triton). So each
request of an extend batch runs SDPA on its own tokens: a chunk that starts the prompt attends
only itself (square causal, cuDNN), a later chunk attends its cached prefix gathered from the
KV pool plus itself: the prefix unmasked and the chunk causally, two cuDNN calls merged by
their log-sum-exp (:func:`prefix_split_sdpa`; FlashAttention's lower-right causal call with
``SGLANG_M3_DENSE_PREFIX_SPLIT=0``; the merge in one Triton pass,
:mod:`msa_kernels.triton_lse_merge`, or as torch ops with ``SGLANG_M3_FUSED_LSE_MERGE=0``).

cuDNN builds an execution plan for every new shape it is given (torch keys its plan cache on the
exact lengths): 50-80 ms of host time on the H100, and seconds when a kernel variant has to be
compiled (``benchmarks/results/prefill_host_h100/``), against a few milliseconds of attention.
Prompts of arbitrary length would pay that on nearly every request. So cuDNN takes only shapes
whose lengths are multiples of :data:`CUDNN_SHAPE_STEP` tokens (the full chunks of chunked
prefill after a prefix of full chunks, which recur from request to request: a bounded set of
plans, each built once); every other shape runs FlashAttention, which plans nothing. The choice
depends on the shape alone, so a request's result does not depend on what ran before it.
``SGLANG_M3_DENSE_CUDNN=always`` gives cuDNN every shape (the A/B switch).

cuDNN's first call of each form compiles its kernel: 0.76 and 1.05 s on the H200 for a chunk without
and after a prefix (``benchmarks/results/cold_start_h200/``), which a server's first long prompt
would pay. So the backend's construction runs each form once on small aligned shapes
(:func:`prepare_cudnn`, 0.3 s); a later new shape then costs its plan alone (about 40 ms, once),
and the full chunks of a long prompt have theirs built at start-up too (:func:`prebuild_chunk_plans`).
Torch's ragged cuDNN path (``TORCH_CUDNN_SDPA_AVOID_RECOMPILE=1``, plans keyed on lengths rounded
up to powers of two) would build fewer plans, but on the H200 its kernels took 6% longer over the
chunks of 32K, 128K, 30001- and 12288-token prompts (292.9 against 276.2 ms), and the prefix split
of a one-token query failed this project's exactness bound under it (torch 2.11,
``benchmarks/results/cold_start_h200/gpu_tests_c70c4f3.log``): it stays off.

Decode, speculative verify and draft batches keep SGLang's backend (they are graphed; this path
is per request and eager). The per-request loop reads host-side lengths; prefill is never
captured whole (SGLang's breakable prefill graphs run attention eagerly on the real tokens).
``SGLANG_M3_DENSE_PREFILL=sglang`` keeps SGLang's kernel for A/B measurements.

The CPU platform takes this path too. SGLang's torch-native backend pads each request's new
queries to its whole length and runs square causal SDPA over all of it, then keeps the last rows:
a chunk after a prefix of ``P`` tokens costs ``(P + n)^2`` instead of ``n * (P + n)``. Serving the
tiny M3 on a 2-core CPU, a repeated 32K-token prompt (a radix hit: one new token) took 19.9 s to
its first token, 88% of the scheduler's samples inside that padded call (py-spy), and the first
prefill of a 16K-token prompt 122 s.

The sparse layers' extend requests that select every block (at most ``topk * block_size``
tokens) make the same per-request call, :func:`causal_sdpa` (:mod:`sglang_m3.msa.full_selection`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from sglang.srt.mem_cache.memory_pool import KVWriteLoc
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from msa_kernels.triton_lse_merge import merge_by_lse, merge_by_lse_reference

from sglang_m3.env_switch import env_choice, env_non_negative_int
from sglang_m3.msa.batch_shape import host_extend_lens

#: Environment switch: ``sdpa`` (default on CUDA and the CPU) or ``sglang`` (SGLang's own extend kernel).
ENV = "SGLANG_M3_DENSE_PREFILL"


@dataclass(frozen=True)
class RequestSpan:
    """One request of an extend batch: its rows of ``q`` and its tokens in the cache."""

    q_start: int
    q_len: int
    prefix_len: int
    slots: torch.Tensor | None  # every cached token of the request (None: no prefix, and the new tokens' K/V as computed)


def sdpa_dense_prefill_enabled(device: torch.device) -> bool:
    """On CUDA and the CPU (the module docstring says why each), unless switched off."""
    return device.type in ("cuda", "cpu") and env_choice(ENV, ("sdpa", "sglang")) == "sdpa"


def plain_causal_call(layer, extra: dict) -> bool:
    """A call of plain causal self-attention: no extra operands, logit cap, sliding window or
    cross-attention, which the plugin's own dense paths do not compute."""
    return (
        not extra
        and getattr(layer, "logit_cap", 0) in (0, 0.0, None)
        and getattr(layer, "sliding_window_size", -1) in (-1, None)
        and not getattr(layer, "is_cross_attention", False)
    )


def serves_batch(forward_batch) -> bool:
    """Plain extend batches (prefill, chunked prefill, mixed): not verify or draft batches."""
    return forward_batch.forward_mode in (ForwardMode.EXTEND, ForwardMode.MIXED)


class SDPADensePrefill:
    """Extend attention of dense layers: cache write, then one SDPA call per request."""

    def __init__(self, model_runner):
        self.req_to_token = model_runner.req_to_token_pool.req_to_token
        self.pool = model_runner.token_to_kv_pool
        self.spans: list[RequestSpan] | None = None

    def plan(self, forward_batch) -> None:
        """Per-request spans of this batch (once per forward, shared by every dense layer)."""
        self.spans = None
        if not serves_batch(forward_batch):
            return
        extend_lens = host_extend_lens(forward_batch)
        prefix_lens = forward_batch.extend_prefix_lens_cpu
        if prefix_lens is None:
            prefix_lens = [int(s) - e for s, e in zip(forward_batch.seq_lens_cpu.tolist(), extend_lens)]
        # What SGLang's backend on each device attends for a request's new tokens: its GPU backends
        # the computed K/V, its CPU (torch-native) backend the cached ones (an fp8 cache's rounded
        # values, which the e4m3 oracle of tests/e2e/test_fp8_kv_served.py rounds too).
        new_tokens_from_cache = self.req_to_token.device.type == "cpu"
        spans, start = [], 0
        for i, (new, prefix) in enumerate(zip(extend_lens, prefix_lens)):
            slots = None
            if prefix or new_tokens_from_cache:
                row = self.req_to_token.index_select(0, forward_batch.req_pool_indices[i : i + 1])[0]
                slots = row[: prefix + new]
            spans.append(RequestSpan(start, int(new), int(prefix), slots))
            start += int(new)
        self.spans = spans

    def takes(self, forward_batch, layer, extra: dict) -> bool:
        """Whether this call is one this path computes exactly as SGLang's backend would."""
        return self.spans is not None and serves_batch(forward_batch) and layer.k_scale is None and plain_causal_call(layer, extra)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True) -> torch.Tensor:
        if save_kv_cache:
            self.pool.set_kv_buffer(layer, KVWriteLoc(forward_batch.out_cache_loc, None), k, v)
        heads, kv_heads = layer.tp_q_head_num, layer.tp_k_head_num
        q = q.view(-1, heads, layer.qk_head_dim)
        k = k.view(-1, kv_heads, layer.qk_head_dim)
        v = v.view(-1, kv_heads, layer.v_head_dim)
        out = q.new_empty(q.shape[0], heads, layer.v_head_dim)
        k_cache = self.pool.get_key_buffer(layer.layer_id)
        v_cache = self.pool.get_value_buffer(layer.layer_id)
        for span in self.spans:
            if span.q_start >= q.shape[0]:
                break  # a padded batch hands over only its real tokens
            rows = slice(span.q_start, span.q_start + span.q_len)
            if span.slots is None:
                keys, values = k[rows], v[rows]
            else:
                # an fp8 cache (no KV scales: ``takes``) holds the values themselves; SDPA wants q's dtype
                keys, values = k_cache[span.slots].to(q.dtype), v_cache[span.slots].to(q.dtype)
            out[rows] = causal_sdpa(q[rows], keys, values, layer.scaling)
        return out.view(-1, heads * layer.v_head_dim)


#: Environment switch: ``aligned`` (default: cuDNN for step-aligned shapes only) or ``always``.
CUDNN_ENV = "SGLANG_M3_DENSE_CUDNN"
#: cuDNN takes a request whose new tokens and keys are both multiples of this many tokens: the
#: 8K chunks of chunked prefill and their prefixes qualify, at most ``chunk / step`` query lengths
#: in all, while a prompt's odd-length last chunk (or a whole short prompt) does not.
CUDNN_SHAPE_STEP = 1024
_FALLBACKS = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)


def prepare_cudnn(heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> float:
    """Every form of cuDNN call run once, so its kernel is compiled; returns the seconds it took.

    The forms are a chunk without prefix (square causal) and a chunk after a prefix (the two calls
    of :func:`prefix_split_sdpa`), at :data:`CUDNN_SHAPE_STEP` tokens a chunk, with this rank's
    heads. Nothing runs where cuDNN never would (not CUDA, not 16-bit).
    """
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        return 0.0
    began = time.perf_counter()
    step = CUDNN_SHAPE_STEP
    q = torch.randn(step, heads, head_dim, device=device, dtype=dtype)
    keys = torch.randn(2 * step, kv_heads, head_dim, device=device, dtype=dtype)
    values = torch.randn_like(keys)
    causal_sdpa(q, keys[step:], values[step:], head_dim**-0.5)
    causal_sdpa(q, keys, values, head_dim**-0.5)
    torch.cuda.synchronize(device)
    return time.perf_counter() - began


#: Environment switch: the longest cached prefix, in tokens, whose full-chunk cuDNN plans the
#: server builds at start-up (:func:`prebuild_chunk_plans`); ``0`` turns the step off.
CHUNK_PLANS_ENV = "SGLANG_M3_DENSE_CUDNN_CHUNK_PLANS"
#: 16 prefixes of 8K chunks: a 128K prompt's whole chunked prefill, in about a second at start-up.
#: Longer contexts would pay more per plan (each runs its attention once over its whole prefix).
DEFAULT_CHUNK_PLAN_PREFIX = 131072


def chunk_plan_prefixes(chunk: int, context: int, longest_prefix: int) -> list[int]:
    """The cached-prefix lengths of the full chunks of chunked prefill that cuDNN takes: ``0`` (a
    prompt's first chunk) and every multiple of ``chunk`` up to ``longest_prefix`` that leaves room
    for a whole chunk in ``context`` tokens. Empty when the chunk is not one cuDNN takes (chunked
    prefill off, or a chunk that is not a multiple of :data:`CUDNN_SHAPE_STEP`)."""
    if chunk <= 0 or not cudnn_takes(chunk, chunk):
        return []
    return list(range(0, min(longest_prefix, context - chunk) + 1, chunk))


def prebuild_chunk_plans(heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                         chunk: int, context: int) -> tuple[int, float]:
    """cuDNN's plans for every full chunk of a long prompt, built before the first request.

    :func:`prepare_cudnn` compiles each form's kernel, but torch keys cuDNN's plans on the exact
    lengths (and strides), so a server's first 32K prompt still built one plan per 8K chunk inside
    the request (its first three chunks took about 200 ms more than the second prompt's on the
    H200 at TP2, ``benchmarks/results/first_prompt_h200/``). The chunks of chunked prefill after a
    prefix of whole chunks recur in every long prompt, so their plans are built here, on tensors
    laid out as the serving call's (``[tokens, heads, dim]`` rows, keys gathered contiguous): the
    first 32K prompt at TP2 then took 201.6 against 414.2 ms, for 0.7 s per rank at start-up. The
    plan cache is per thread: this runs on the scheduler's thread, which runs the forward too.
    Returns how many chunk shapes were prepared and the seconds taken; nothing runs where cuDNN
    never would, or with ``SGLANG_M3_DENSE_CUDNN_CHUNK_PLANS=0``.
    """
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        return 0, 0.0
    longest = env_non_negative_int(CHUNK_PLANS_ENV, DEFAULT_CHUNK_PLAN_PREFIX)
    prefixes = chunk_plan_prefixes(chunk, context, longest) if longest else []
    if not prefixes:
        return 0, 0.0
    began = time.perf_counter()
    q = torch.randn(chunk, heads, head_dim, device=device, dtype=dtype)
    keys = torch.randn(prefixes[-1] + chunk, kv_heads, head_dim, device=device, dtype=dtype)
    values = torch.randn_like(keys)
    for prefix in prefixes:
        causal_sdpa(q, keys[: prefix + chunk], values[: prefix + chunk], head_dim**-0.5)
    torch.cuda.synchronize(device)
    return len(prefixes), time.perf_counter() - began


def cudnn_takes(n: int, length: int) -> bool:
    """Whether cuDNN attends ``n`` new tokens over ``length`` keys (see the module's docstring)."""
    if env_choice(CUDNN_ENV, ("aligned", "always")) == "always":
        return True
    return n % CUDNN_SHAPE_STEP == 0 and length % CUDNN_SHAPE_STEP == 0


def causal_sdpa(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal GQA attention of one request's new tokens over its keys: ``[n, Hq, Dv]``.

    ``q [n, Hq, D]`` are the last ``n`` of the ``L`` positions of ``keys`` / ``values [L, Hkv, D]``
    (same dtype as ``q``). ``n == L`` (a chunk without cached prefix): square causal, cuDNN first
    where :func:`cudnn_takes` the shape. With a cached prefix on CUDA in 16-bit, a shape cuDNN
    takes: :func:`prefix_split_sdpa`, and with a prefix on the CPU the same split over the CPU's
    flash kernel. Otherwise FlashAttention first (causal aligned to the last key, lower right,
    after a prefix). Every form falls back to the efficient and math kernels
    where its first choice cannot run (fp32, the CPU).
    """
    n, length = q.shape[0], keys.shape[0]
    if n == length:
        mask, causal = None, True
        backend = SDPBackend.CUDNN_ATTENTION if cudnn_takes(n, length) else SDPBackend.FLASH_ATTENTION
    elif prefix_split_applies(q) and cudnn_takes(n, length):
        return prefix_split_sdpa(q, keys, values, scale)
    elif cpu_split_applies(q):
        return prefix_split_sdpa(q, keys, values, scale, attention=_cpu_flash_attention_with_lse)
    else:
        mask, causal, backend = causal_lower_right(n, length), False, SDPBackend.FLASH_ATTENTION
    with sdpa_kernel([backend, *(fallback for fallback in _FALLBACKS if fallback != backend)]):
        attended = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None],
            attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=q.shape[1] != keys.shape[1],
        )
    return attended[0].transpose(0, 1)


#: Environment switch for :func:`prefix_split_sdpa` (``1``, the default, or ``0``: FlashAttention's
#: lower-right causal call, for A/B measurements).
PREFIX_SPLIT_ENV = "SGLANG_M3_DENSE_PREFIX_SPLIT"


def cpu_split_applies(q: torch.Tensor) -> bool:
    """On the CPU a chunk after a prefix in a serving dtype takes the split (its flash kernel plans
    nothing). Not in float64, the dtype of this module's exactness tests: the CPU's flash kernel
    was 1e-7 off the float64 reference there (float32 rounding), the masked path exact."""
    return q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16, torch.float16)


def prefix_split_applies(q: torch.Tensor) -> bool:
    return env_choice(PREFIX_SPLIT_ENV, ("1", "0")) == "1" and q.is_cuda and q.dtype in (torch.bfloat16, torch.float16)


def _cudnn_attention_with_lse(q, keys, values, scale: float, causal: bool):
    """``(out [n, Hq, Dv], lse [n, Hq, 1] fp32)`` of cuDNN attention (top-left causal when asked)."""
    out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(
        *_heads_first(q, keys, values), None, True, 0.0, causal, False, scale=scale,
    )[:2]
    return _tokens_first(out, lse)


def _cpu_flash_attention_with_lse(q, keys, values, scale: float, causal: bool):
    """:func:`_cudnn_attention_with_lse`'s result from the CPU's flash attention; the KV heads are
    repeated for the query groups (the op takes equal head counts)."""
    group = q.shape[1] // keys.shape[1]
    keys, values = (x.repeat_interleave(group, dim=1) if group > 1 else x for x in (keys, values))
    return _tokens_first(*torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        *_heads_first(q, keys, values), 0.0, causal, scale=scale,
    ))


def _heads_first(*tensors):
    """``[tokens, heads, dim]`` tensors as the ``[1, heads, tokens, dim]`` the attention ops take."""
    return [x.transpose(0, 1)[None] for x in tensors]


def _tokens_first(out, lse):
    """An attention op's ``[1, heads, n, Dv]`` output and ``[1, heads, n]`` log-sum-exp as
    ``[n, heads, Dv]`` and fp32 ``[n, heads, 1]``."""
    heads, n = out.shape[1], out.shape[2]
    return out[0].transpose(0, 1), lse.reshape(heads, n).transpose(0, 1)[..., None].float()


def prefix_split_sdpa(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float, attention=None) -> torch.Tensor:
    """:func:`causal_sdpa` of a chunk after a cached prefix as two attention calls merged by log-sum-exp.

    The new tokens see the whole prefix (no mask) and themselves causally (square, top-left); cuDNN
    runs both unmasked forms, while the single lower-right causal call it would need with a mask
    ran slower than FlashAttention's (``benchmarks/dense_prefill.py``). Each call returns its
    softmax normaliser per (head, token), so the two partial outputs combine exactly.
    ``attention``: cuDNN's call by default; the CPU passes its flash kernel's
    (:func:`_cpu_flash_attention_with_lse`): there the one lower-right causal call builds its
    ``[n, L]`` mask and takes SDPA's masked path, 3.1 of the 8.7 s a 16K-token prompt's forward
    took on 2 cores with the tiny M3 (py-spy).
    """
    attention = attention or _cudnn_attention_with_lse  # looked up per call (tests swap it)
    n, length = q.shape[0], keys.shape[0]
    prefix = length - n
    out_prefix, lse_prefix = attention(q, keys[:prefix], values[:prefix], scale, causal=False)
    out_self, lse_self = attention(q, keys[prefix:], values[prefix:], scale, causal=True)
    merge = merge_by_lse if fused_merge_serves(out_prefix) else merge_by_lse_reference
    return merge(out_prefix, lse_prefix, out_self, lse_self)


#: Environment switch: ``1``, the default, merges the prefix split's two outputs in one Triton pass
#: on CUDA (:mod:`msa_kernels.triton_lse_merge`; its GPU test finds the torch ops' bits) instead of
#: seven torch passes: 12.9x faster at an 8K chunk on the H200, and 1.2% off a 32K prompt's TTFT
#: (``benchmarks/results/lse_merge_h200.json``, the paired A/B beside it); ``0`` keeps the torch ops.
FUSED_MERGE_ENV = "SGLANG_M3_FUSED_LSE_MERGE"


def fused_merge_on() -> bool:
    """The switch's state (checked: any value but ``1`` or ``0`` is refused, naming it)."""
    return env_choice(FUSED_MERGE_ENV, ("1", "0"), "'1' (one Triton pass on CUDA) or '0' (torch ops)") == "1"


def fused_merge_serves(out: torch.Tensor) -> bool:
    """Whether the Triton merge takes these partial outputs: CUDA tensors, with the switch on."""
    return fused_merge_on() and out.is_cuda
