"""EAGLE draft trees through ``MSATritonBackend`` (the CUDA code path) on the CPU under the Triton interpreter.

Verify batches are shaped as SGLang shapes them: each request's drafts follow its ``seq_lens``
tokens in ``req_to_token``; the tree comes from a random draft pass formed as SGLang's EAGLE
worker forms it, built into SGLang's tree mask (FULL_MASK or QLEN_ONLY) by the torch tree builder
that ``tests/speculative/test_torch_kernels.py`` checks against SGLang's Triton builder. The
backend reads the tree from that mask only. Its output must equal the torch tree path
(``MSATorchBackend``, itself checked against a brute-force oracle in
``tests/speculative/test_tree_verify_attention.py``), and its selections the reference's: every
token answered as the decode query at the end of its root-to-token path. Eager plans and CUDA-graph
plans (capture with a dummy mask, replays with real ones, padded rows) are both covered.
"""

from types import SimpleNamespace

import pytest
import torch

from msa_kernels.paged_batch import compare_with_reference, make_paged_batch
from msa_triton_fakes import BLOCK, D, HKV, HQ, PARAMS, SPEC, attend, fake_runner, forward_batch, make_backend
from sglang_m3.msa.verify_tree import draft_paths, draft_visibility
from sglang_m3.speculative.torch_kernels import FULL_MASK, QLEN_ONLY, build_tree
from tests.kernels.test_msa_graph_metadata import MAX_BS, GraphRunnerDouble, _addresses
from tests.speculative.draft_trees import random_draft_pass

TOPK, STEPS, N = 3, 3, 8  # the served tree shape: top-3, 3 steps, 8 verify tokens


def sglang_tree(seq_lens: list[int], seed: int, mode: int = FULL_MASK, fill: int = 1):
    """``(custom_mask, positions, parents per request)`` of a random top-3 x 3 draft pass.

    ``fill``: what the mask's cells hold before the builder writes the tree (SGLang fills the
    prefix columns with True; the tree cells are always written)."""
    gen = torch.Generator().manual_seed(seed)
    prefix = torch.tensor(seq_lens)
    parent_list, selected = random_draft_pass(gen, len(seq_lens), TOPK, STEPS, N)
    cells = N * (int(prefix.sum()) if mode == FULL_MASK else 0) + N * N * len(seq_lens)
    mask = torch.full((cells,), bool(fill))
    positions = torch.empty(len(seq_lens) * N, dtype=torch.long)
    build_tree(parent_list, selected, prefix, mask, positions, *torch.full((3, len(seq_lens), N), -1), TOPK, STEPS, N, mode)
    parents = [[path[-2] if len(path) > 1 else -1 for path in draft_paths(rows)] for rows in draft_visibility(mask, seq_lens, N)]
    return mask, positions, parents


def few_programs(backend):
    """The backend sizing its grids for a 2-SM device: the interpreter runs programs one by one."""
    backend.num_sms = 2
    return backend


def tree_spec_info(mask):
    return SimpleNamespace(tree_topk=TOPK, topk=TOPK, draft_token_num=N, num_tokens_per_req=N, custom_mask=mask)


def paged_tree_batch(prefixes, seed, mode=FULL_MASK):
    """A paged batch of ``prefixes`` plus N drafts each, its SGLang verify ForwardBatch double and the trees."""
    batch = make_paged_batch(
        [p + N for p in prefixes], [N] * len(prefixes), HQ, HKV, D, D, BLOCK, torch.float32, "cpu",
        decode_q_len=N, generator=torch.Generator().manual_seed(seed),
    )
    mask, positions, parents = sglang_tree(prefixes, seed, mode)
    fb = forward_batch("TARGET_VERIFY", batch)
    fb.spec_info = tree_spec_info(mask)
    fb.positions = positions
    return batch.with_draft_trees(parents), fb


@pytest.mark.parametrize(
    "prefixes, mode",
    [
        # prefix tails 5 and 2 short of a block of 16 (paths cross it), one on a block boundary
        ([75, 30, 64], FULL_MASK),
        ([13, 94], QLEN_ONLY),
    ],
)
def test_eager_tree_verify_equals_the_torch_tree_path_and_the_reference(backend_module, prefixes, mode):
    from sglang_m3.msa.backend import MSATorchBackend

    batch, fb = paged_tree_batch(prefixes, seed=len(prefixes) + mode, mode=mode)
    assert any(len(path) > 2 for b in range(len(prefixes)) for path in batch.paths_of(b)), "a tree with depth"
    triton = few_programs(make_backend(backend_module, batch))
    triton.model_runner.attn_backend = SimpleNamespace(verify_mask=SimpleNamespace(mode=mode))
    triton.init_forward_metadata(fb)
    assert triton.kernel_plan.tree is not None
    got = attend(triton, batch)

    caches = SimpleNamespace(k_cache=batch.k_cache, v_cache=batch.v_cache, ik_cache=batch.ik_cache[:, 0])  # torch: [slots, Di]
    torch_path = MSATorchBackend(fake_runner(batch.req_to_token.flip(0), lambda: caches), SPEC)
    torch_path.init_forward_metadata(fb)
    torch.testing.assert_close(got, attend(torch_path, batch), rtol=1e-4, atol=1e-4)

    from msa_kernels.api import decode_select

    selected = decode_select(triton.kernel_plan, batch.iq, batch.ik_cache)
    agreement = compare_with_reference(batch, PARAMS, got, selected, rel_tol=1e-4)
    assert agreement.ok, agreement.failures


def test_a_chain_read_of_the_tree_would_differ(backend_module):
    """The same batch verified as a chain (every draft after the ones before it by slot) answers
    differently: the tree's reading is what the test above checks, not an accident of the data."""
    batch, fb = paged_tree_batch([75, 30], seed=7)
    backend = few_programs(make_backend(backend_module, batch))
    backend.init_forward_metadata(fb)
    tree_out = attend(backend, batch)
    fb.spec_info = forward_batch("TARGET_VERIFY", batch).spec_info  # SGLang's chain input, topk 1
    backend.init_forward_metadata(fb)
    assert backend.kernel_plan.tree is None
    chain_out = attend(backend, batch)
    for b in range(2):
        for token, path in enumerate(batch.paths_of(b)):
            row = b * N + token
            same = torch.allclose(tree_out[row], chain_out[row], rtol=1e-4, atol=1e-4)
            assert same == (path == list(range(token + 1))), f"request {b} token {token}, path {path}"


class TreeGraphRunner(GraphRunnerDouble):
    """SGLang's verify graph runner for draft trees: the capture's spec_info holds the runner's
    all-True mask buffer; each replay's spec_info holds the batch's real tree mask."""

    def __init__(self, module, fill):
        super().__init__(module, "TARGET_VERIFY", N, fill)
        few_programs(self.backend).init_cuda_graph_state(MAX_BS, MAX_BS * N)
        self.spec_info = tree_spec_info(torch.ones((MAX_BS * fill + MAX_BS * N) * N, dtype=torch.bool))

    def load_trees(self, kv_lens, pool_rows, seed):
        self.load(kv_lens, pool_rows, seed)
        mask, _, parents = sglang_tree([kv - N for kv in kv_lens], seed)
        self.spec_info = tree_spec_info(mask)
        self.batch = self.batch.with_draft_trees(parents)


@pytest.mark.parametrize("fill", [1, 0])
def test_graph_capture_then_tree_replays_keep_addresses_and_match_reference(backend_module, fill):
    from tests.kernels.test_msa_graph_metadata import _assert_real_rows_match

    runner = TreeGraphRunner(backend_module, fill)
    runner.load([41, 150, 18], [5, 0, 3], seed=0)  # capture: the runner's dummy mask, a chain batch's caches
    runner.step(MAX_BS, in_capture=True)
    captured = _addresses(runner.backend.kernel_plan) + [t.data_ptr() for t in vars(runner.backend.kernel_plan.tree).values()]
    for seed, (kv_lens, pool_rows) in enumerate([([84, 33 + N, 16 + N, 96], [1, 2, 6, 7]), ([64 + N, 129], [2, 6])], start=1):
        runner.load_trees(kv_lens, pool_rows, seed)
        out = runner.step(MAX_BS, in_capture=False)
        plan = runner.backend.kernel_plan
        assert _addresses(plan) + [t.data_ptr() for t in vars(plan.tree).values()] == captured, f"replay {seed}: the plan moved"
        _assert_real_rows_match(runner, out)
