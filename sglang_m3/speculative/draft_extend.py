"""An EAGLE draft's extend over the verify window, for an M3 target, on the MSA decode kernels.

After every verify, SGLang's EAGLE worker (v2) runs the draft model once over the verify window
(DRAFT_EXTEND_V2, :mod:`sglang_m3.msa.batch_shape`): each request's window tokens attend causally
after its prefix. The draft's Triton backend runs that with SGLang's extend kernel, one program
per (request, query head) walking the whole prefix: on the H200 it took 167 us of every chain-of-3
cycle at a 2K context for the mid-size draft (``benchmarks/results/dense_verify_h200/``), where
the target's dense layer attends the same window on the MSA decode kernels in about 12 us
(:mod:`sglang_m3.msa.dense_decode`). M3 serves with the MSA block as its KV page, so the draft's
pages (its own pool, the target's ``req_to_token``) fit the same plans: :class:`DraftExtendPlans`
plans those batches (eagerly, or in the static buffers of :mod:`sglang_m3.msa.graph_plan` for
SGLang's draft-extend CUDA graphs) and attends them over every block; the draft's other batches
and any layer the kernels do not compute stay with SGLang's backend.

``SGLANG_M3_DRAFT_EXTEND``: ``msa`` (the default) or ``sglang`` (SGLang's backend throughout).
On the H200 (``benchmarks/results/draft_extend_h200/``) the attention alone, in CUDA graphs at the
mid-size draft's heads, took 22.7 against SGLang's 121.5 us for one request at 2K and 103 against
2,198 us at 32K; served, the chain-of-3 cycle's kernels fell from 3.72 to 3.62 ms at 2K, and
servers run one at a time on one lease gave ``msa`` 0.93-0.97 against 0.96-1.11 ms per token. An
earlier A/B with both servers alive (``msa`` started first) had timed ``msa`` slower at
concurrency 1 (1.765 against 1.119 ms); that did not recur, and its cause is not known.
"""

from __future__ import annotations

import functools
import logging

import torch
from msa_kernels.plan import DecodePlan, plan_decode
from msa_kernels.reference import MSAParams

from sglang_m3.env_switch import env_choice
from sglang_m3.msa import dense_decode
from sglang_m3.msa.batch_shape import draft_extend_q_len
from sglang_m3.msa.graph_plan import GraphDecodePlans, graph_context_tokens
from sglang_m3.msa.triton_backend import page_table_for

logger = logging.getLogger(__name__)

ENV = "SGLANG_M3_DRAFT_EXTEND"
#: logged once per server at the first window the kernels attend (tests look for it in server logs)
TAKEN_MESSAGE = "the draft's extend over the verify window runs on the MSA decode kernels"


def enabled() -> bool:
    return env_choice(ENV, ("msa", "sglang")) == "msa"


def kernel_head_dim(layer) -> bool:
    """Whether the kernels take the layer's heads: equal K/V head dims, a power of two >= 16."""
    d = layer.qk_head_dim
    return d == layer.v_head_dim and d >= 16 and d & (d - 1) == 0


class DraftExtendPlans:
    """The MSA decode-kernel plans of a draft's DRAFT_EXTEND_V2 batches, and their attention.

    ``req_to_token`` is the pool the target shares with its draft; ``kv_pool`` the draft's own
    (its heads size the plans); ``params.block_size`` the KV page size.
    """

    def __init__(self, req_to_token: torch.Tensor, kv_pool, params: MSAParams, context_len: int, num_sms: int, device):
        self.req_to_token = req_to_token
        self.kv_pool = kv_pool
        self.params = params
        self.num_kv_heads = kv_pool.head_num
        self.context_len = context_len
        self.num_sms = num_sms
        self.device = torch.device(device)
        self.plan: DecodePlan | None = None  # the current batch's, None when it is not one of ours
        self.graph_plans: GraphDecodePlans | None = None
        self._logged = False

    def plan_eager(self, forward_batch) -> None:
        """Plan a batch SGLang runs without a graph (host lengths when it has them: no sync)."""
        q_len = draft_extend_q_len(forward_batch)
        self.plan = None
        if q_len is None:
            return
        on_host = forward_batch.seq_lens_cpu
        longest = int(on_host.max()) if on_host is not None and on_host.numel() else self.req_to_token.shape[1]
        table = page_table_for(self.req_to_token, forward_batch.req_pool_indices, longest, self.params.block_size)
        self.plan = plan_decode(
            self.params, table, forward_batch.seq_lens, q_len=q_len, num_kv_heads=self.num_kv_heads, num_sms=self.num_sms,
        )

    def init_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        """Static plans for graphs of up to ``max_bs`` requests of ``max_num_tokens / max_bs`` window tokens."""
        max_tokens = graph_context_tokens(self.req_to_token.shape[1], self.context_len, max_bs, max_num_tokens)
        self.graph_plans = GraphDecodePlans(self.params, max_bs, max_tokens, self.num_kv_heads, self.num_sms, self.device)

    def plan_graphed(self, forward_batch) -> None:
        """Host side of capture and replay: the static plan of this batch's shape."""
        q_len = draft_extend_q_len(forward_batch)
        self.plan = None
        if q_len is None:
            return
        if self.graph_plans is None:
            raise RuntimeError("a graphed draft extend before init_cuda_graph_state: no static MSA plan buffers")
        # At replay SGLang's draft-extend runner hands over its whole buffers (max_bs rows): the
        # batch is the first ``batch_size`` of them.
        batch = forward_batch.batch_size
        on_host = forward_batch.seq_lens_cpu
        longest = int(on_host[:batch].max()) if on_host is not None and batch else None
        self.plan = self.graph_plans.plan(batch, q_len, longest)

    def refresh_graphed(self, forward_batch) -> None:
        """Device side, recorded in the graph: page ids and window positions from the runner's buffers."""
        if self.plan is None:
            return
        self.graph_plans.refresh(self.plan, self.req_to_token, forward_batch.req_pool_indices, forward_batch.seq_lens, True)

    def takes(self, layer, forward_batch, extra: dict) -> bool:
        """Whether this layer's call in this batch is one the plan's kernels compute as SGLang would."""
        return (
            self.plan is not None
            and draft_extend_q_len(forward_batch) == self.plan.tiles.max_tokens
            and kernel_head_dim(layer)
            and dense_decode.computes_call(layer, self.plan, extra)
        )

    def attend(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True) -> torch.Tensor:
        if not self._logged:
            self._logged = True
            logger.info("%s (%s=msa)", TAKEN_MESSAGE, ENV)
        return dense_decode.attend(self.kv_pool, self.plan, q, k, v, layer, forward_batch, save_kv_cache)


@functools.cache
def triton_backend_class():
    """SGLang's Triton backend with draft extends on the MSA kernels (a subclass, so that every
    other behaviour, graph hook and attribute SGLang reads stays SGLang's own)."""
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend

    class MsaDraftExtendTritonBackend(TritonAttnBackend):
        def __init__(self, model_runner, plans: DraftExtendPlans, **kwargs):
            super().__init__(model_runner, **kwargs)
            self.msa_plans = plans

        def init_forward_metadata(self, forward_batch):
            super().init_forward_metadata(forward_batch)
            self.msa_plans.plan_eager(forward_batch)

        def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int, *args, **kwargs):
            super().init_cuda_graph_state(max_bs, max_num_tokens, *args, **kwargs)
            self.msa_plans.init_graph_state(max_bs, max_num_tokens)

        def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False):
            super().init_forward_metadata_out_graph(forward_batch, in_capture)
            self.msa_plans.plan_graphed(forward_batch)

        def init_forward_metadata_in_graph(self, forward_batch):
            super().init_forward_metadata_in_graph(forward_batch)
            self.msa_plans.refresh_graphed(forward_batch)

        def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
            if self.msa_plans.takes(layer, forward_batch, kwargs):
                return self.msa_plans.attend(q, k, v, layer, forward_batch, save_kv_cache)
            return super().forward_extend(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)

    return MsaDraftExtendTritonBackend
