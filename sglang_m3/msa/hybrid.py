"""Routes each attention call to the MSA backend (sparse layers) or SGLang's backend (dense layers).

CUDA graphs: SGLang's graph runners talk to this one backend, so every graph hook whose work or
answer concerns both halves reaches both (state allocation, the out-of-graph and in-graph
metadata, warmup and recapture hooks, where shared reads end); the hooks about dense-only
machinery (the padded ``seq_len`` fill value, the speculative tree mask) are the dense backend's,
and the MSA backend copes with the dense fill value (see ``sglang_m3.msa.graph_plan``).
"""

from __future__ import annotations

from sglang.srt.layers.attention.base_attn_backend import AttentionBackend, SharedReadEnds


class M3HybridAttnBackend(AttentionBackend):
    """Both backends plan every batch (SGLang's not one whose dense layers all run on the MSA
    kernels, see ``_dense_backend_plans``); a call goes to the one that owns its layer, or to the
    plugin's own dense path where that takes it.

    ``__getattr__`` never sees what ``AttentionBackend`` itself defines, so the graph hooks
    whose base defaults would hide the children's answers are defined here. The remaining base
    defaults (no ragged verify graphs, no metadata glue graph, no breakable-graph metadata) are
    what the MSA backend supports. Anything the base class lacks goes to the dense backend.
    """

    def __init__(self, dense: AttentionBackend, sparse: AttentionBackend, sparse_layer_ids, dense_prefill=None, dense_layers=()):
        self.dense = dense
        self.sparse = sparse
        self.sparse_layer_ids = frozenset(sparse_layer_ids)
        # Extend batches of dense layers (``sglang_m3.msa.dense_prefill``); None keeps SGLang's.
        self.dense_prefill = dense_prefill
        # Whether the MSA backend can attend every one of the model's dense layers (their attention
        # modules, ``dense_layers``; none given: not known, so SGLang's backend always plans).
        self.dense_layers_on_msa = bool(dense_layers) and all(sparse.computes_dense_layer(layer) for layer in dense_layers)
        self._dense_planned = True  # whether SGLang's backend planned the current batch
        # Class-level defaults of AttentionBackend would shadow the delegation below.
        self.kv_index_translator = dense.kv_index_translator
        self.attn_backend_list = [dense, sparse]

    def __getattr__(self, name):
        # Only reached for attributes this class does not define.
        if name in ("dense", "sparse", "sparse_layer_ids", "dense_prefill", "dense_layers_on_msa", "_dense_planned"):
            raise AttributeError(name)
        return getattr(self.dense, name)

    def _dense_backend_plans(self, forward_batch) -> bool:
        """Whether SGLang's backend plans this batch: not when the MSA backend attends every dense
        layer of it (verify and decode batches unless switched off: ``sglang_m3.msa.dense_decode``).
        Its plan would go unread, and at concurrency 1 a decode step is as long as the host's work:
        the plan's index fill and split count are Triton launches, about a tenth of the step's
        host samples in the H200 py-spy profile (``benchmarks/results/speculative_gpu_h200/``)."""
        self._dense_planned = not (self.dense_layers_on_msa and self.sparse.takes_dense_batch(forward_batch))
        return self._dense_planned

    def init_forward_metadata(self, forward_batch):
        if self._dense_backend_plans(forward_batch):
            self.dense.init_forward_metadata(forward_batch)
        self.sparse.init_forward_metadata(forward_batch)
        if self.dense_prefill is not None:
            self.dense_prefill.plan(forward_batch)

    def init_forward_metadata_out_graph(self, forward_batch, in_capture=False):
        if self._dense_backend_plans(forward_batch):
            self.dense.init_forward_metadata_out_graph(forward_batch, in_capture)
        self.sparse.init_forward_metadata_out_graph(forward_batch, in_capture)

    def init_forward_metadata_in_graph(self, forward_batch):
        if self._dense_backend_plans(forward_batch):
            self.dense.init_forward_metadata_in_graph(forward_batch)
        self.sparse.init_forward_metadata_in_graph(forward_batch)

    def init_cuda_graph_state(self, max_bs, max_num_tokens):
        self.dense.init_cuda_graph_state(max_bs, max_num_tokens)
        self.sparse.init_cuda_graph_state(max_bs, max_num_tokens)

    def get_cuda_graph_seq_len_fill_value(self):
        return self.dense.get_cuda_graph_seq_len_fill_value()

    def on_after_cuda_graph_warmup(self):
        self.dense.on_after_cuda_graph_warmup()
        self.sparse.on_after_cuda_graph_warmup()

    def validate_elastic_cuda_graph_recapture(self):
        self.dense.validate_elastic_cuda_graph_recapture()
        self.sparse.validate_elastic_cuda_graph_recapture()

    def shared_read_ends(self, fm) -> SharedReadEnds:
        return SharedReadEnds.max_of((self.dense.shared_read_ends(fm), self.sparse.shared_read_ends(fm)))

    @property
    def extend_dummy_seqs_capped_by_req_pool(self) -> bool:
        return self.dense.extend_dummy_seqs_capped_by_req_pool or self.sparse.extend_dummy_seqs_capped_by_req_pool

    @property
    def verify_mask(self):
        return self.dense.verify_mask

    def update_verify_buffers_to_fill_after_draft(self, spec_info, cuda_graph_bs):
        self.dense.update_verify_buffers_to_fill_after_draft(spec_info, cuda_graph_bs)

    def _owner(self, layer) -> AttentionBackend:
        return self.sparse if layer.layer_id in self.sparse_layer_ids else self.dense

    def _plugin_dense_path(self, layer, forward_batch, kwargs):
        """The plugin's own path for a dense layer's call, when one takes it: SDPA for plain
        extend batches (``sglang_m3.msa.dense_prefill``), the MSA decode kernels for verify and
        decode batches (``sglang_m3.msa.dense_decode``). None leaves the call to the layer's owner."""
        if layer.layer_id in self.sparse_layer_ids:
            return None
        if self.dense_prefill is not None and self.dense_prefill.takes(forward_batch, layer, kwargs):
            return self.dense_prefill.forward_extend
        if self.sparse.takes_dense_layer(layer, forward_batch, kwargs):
            return self.sparse.forward_dense_layer
        if not self._dense_planned:
            raise RuntimeError(
                f"dense layer {layer.layer_id}'s call ({sorted(kwargs)} extra operands) is one the MSA decode kernels do not "
                f"compute, in a {forward_batch.forward_mode.name} batch SGLang's backend did not plan: set "
                "SGLANG_M3_DENSE_VERIFY=sglang / SGLANG_M3_DENSE_DECODE=sglang"
            )
        return None

    def forward(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        path = self._plugin_dense_path(layer, forward_batch, kwargs)
        if path is not None:
            return path(q, k, v, layer, forward_batch, save_kv_cache)
        return self._owner(layer).forward(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        path = self._plugin_dense_path(layer, forward_batch, kwargs)
        if path is not None:
            return path(q, k, v, layer, forward_batch, save_kv_cache)
        return self._owner(layer).forward_extend(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        path = self._plugin_dense_path(layer, forward_batch, kwargs)
        if path is not None:
            return path(q, k, v, layer, forward_batch, save_kv_cache)
        return self._owner(layer).forward_decode(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)
