"""The MXFP8 W8A16 MoE kernels compiled on CUDA, at M3's real expert shape, and served.

Kernel: 128 experts, hidden 6144, intermediate 3072, top-4, swiglu-oai, against the fp32
dequantized reference (``msa_kernels.mxfp8_moe_reference``, TF32 off) on every GEMM path: the
core with fp16 dots (decode 1, 16, 64 tokens and 512) and bf16 dots (1, 64), widen (1 token and a
2048-token prefill chunk, every expert hit), plus token rows past fp16's range and far below it on
both core paths; the tolerance of the
interpreter tests (``tests/kernels/test_mxfp8_moe.py``: relative Frobenius error <= 6e-3, every
element within 1e-2 of the largest output). Then what only a GPU shows: the call captured in a
CUDA graph and replayed on new tokens and routing, and two runs bit-identical (the alignment is a
stable sort). fp32 activations (W8A32) on the GEMV, core and widen paths at the same shape and
in a decode graph, within summation-order noise of the fp32 reference
(``mxfp8_moe_reference.assert_fp32_close``).

Served: the tiny MXFP8 checkpoint in bf16 (experts kept in MXFP8, decode graphs) against its
dequantized twin on the BF16 fused MoE, both against transformers' fp32 on the twin: the MXFP8
path adds no error beyond the bf16 noise (``tests/gpu/test_tiny_m3_gpu.py`` states the criterion).
In fp32 the same pair (the twin on the static torch MoE) must serve identical greedy tokens.
Skipped without CUDA. Run on the lent GPU with ``scripts/gpu/run.sh tests``.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

EXPERTS, HIDDEN, INTER, TOP_K = 128, 6144, 3072, 4
ALPHA, LIMIT = 1.702, 7.0


@pytest.fixture(scope="module")
def experts():
    """M3-shaped MXFP8 experts: e4m3 elements ~N(0, 64), scale bytes 112..118 (2**-15..2**-9)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    tensors = []
    for rows, cols in ((2 * INTER, HIDDEN), (HIDDEN, INTER)):
        elements = torch.empty(EXPERTS, rows, cols, dtype=torch.float8_e4m3fn, device="cuda")
        for e in range(EXPERTS):
            values = torch.randn(rows, cols, generator=gen, device="cuda", dtype=torch.bfloat16) * 64
            elements[e] = values.clamp(-448, 448).to(torch.float8_e4m3fn)
        scales = torch.randint(112, 119, (EXPERTS, rows, cols // 32), generator=gen, device="cuda", dtype=torch.uint8)
        tensors += [elements, scales]
    return tuple(tensors)


def routing(tokens: int, seed: int, dtype: torch.dtype = torch.bfloat16):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    # gate/up of standard deviation ~2 (weights ~0.054 rms): some rows beyond the swiglu-oai clamp
    x = (torch.randn(tokens, HIDDEN, generator=gen, device="cuda") * 0.5).to(dtype)
    ids = torch.rand(tokens, EXPERTS, generator=gen, device="cuda").argsort(dim=1)[:, :TOP_K].to(torch.int32)
    weights = torch.rand(tokens, TOP_K, generator=gen, device="cuda") + 0.1
    return x, ids, weights


def assert_close(got, want):
    assert got.dtype == torch.bfloat16 and torch.isfinite(got).all()
    got, want = got.double(), want.double()
    rel = ((got - want).norm() / want.norm()).item()
    worst = (got - want).abs().max().item()
    print(f"[mxfp8 moe gpu] T={got.shape[0]}: relative error {rel:.2e}, max {worst / want.abs().max().item():.2e} of scale")
    assert rel <= 6e-3, f"relative Frobenius error {rel:.3e}"
    assert worst <= 1e-2 * want.abs().max().item()


def reference(x, ids, weights, experts):
    from msa_kernels.mxfp8_moe_reference import reference_fused_experts

    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        return reference_fused_experts(x, *experts, weights, ids, ALPHA, LIMIT)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous


@pytest.mark.parametrize(
    "tokens, path",
    [(1, "fp16"), (16, "fp16"), (64, "fp16"), (512, "fp16"), (1, "bf16"), (64, "bf16"), (1, "widen"), (2048, "widen")],
)
def test_m3_shape_matches_reference(experts, tokens, path):
    from msa_kernels.triton_mxfp8_moe import mxfp8_fused_experts

    x, ids, weights = routing(tokens, seed=tokens)
    got = mxfp8_fused_experts(x, *experts, weights, ids, ALPHA, LIMIT, path=path)
    assert_close(got, reference(x, ids, weights, experts))
    assert torch.equal(mxfp8_fused_experts(x, *experts, weights, ids, ALPHA, LIMIT, path=path), got), "two runs differ"


@pytest.mark.parametrize("path", ["fp16", "bf16"])
def test_core_paths_rows_of_any_magnitude(experts, path):
    """Compiled core paths, rows scaled by 2**20 (past fp16's 65504), 2**-40 (activations past its
    subnormals) and 0 among ordinary ones: each row within the bound of its own magnitude."""
    from msa_kernels.triton_mxfp8_moe import mxfp8_fused_experts

    x, ids, weights = routing(5, seed=9)
    factors = torch.tensor([2.0**20, 1.0, 2.0**-40, 0.0, 1.0], device="cuda")
    x = (x.float() * factors[:, None]).to(torch.bfloat16)
    got = mxfp8_fused_experts(x, *experts, weights, ids, ALPHA, LIMIT, path=path)
    want = reference(x, ids, weights, experts)
    assert torch.equal(got[3].float(), torch.zeros_like(want[3]))
    for row in (0, 1, 2, 4):
        assert_close(got[row : row + 1], want[row : row + 1])


def assert_graph_replays_new_routing(experts, tokens: int, capture_seed: int, replay_seed: int, path=None, dtype=torch.bfloat16):
    """Capture one call at ``tokens`` tokens of ``dtype``, then replay it on two new routings against
    the reference (bf16: :func:`assert_close`; fp32: ``assert_fp32_close``)."""
    from msa_kernels.mxfp8_moe_reference import assert_fp32_close
    from msa_kernels.triton_mxfp8_moe import mxfp8_fused_experts

    check = assert_close if dtype == torch.bfloat16 else assert_fp32_close
    x, ids, weights = routing(tokens, seed=capture_seed, dtype=dtype)
    mxfp8_fused_experts(x, *experts, weights, ids, ALPHA, LIMIT, path=path)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = mxfp8_fused_experts(x, *experts, weights, ids, ALPHA, LIMIT, path=path)
    for seed in (1, 2):
        new_x, new_ids, new_weights = routing(tokens, seed=replay_seed + seed, dtype=dtype)
        x.copy_(new_x)
        ids.copy_(new_ids)
        weights.copy_(new_weights)
        graph.replay()
        torch.cuda.synchronize()
        check(out, reference(new_x, new_ids, new_weights, experts))


@pytest.mark.parametrize("tokens", [1, 16, 64])
def test_captured_in_a_cuda_graph_and_replayed_on_new_routing(experts, tokens):
    assert_graph_replays_new_routing(experts, tokens, 100 + tokens, 200 + 10 * tokens)


def test_expert_parallel_half_matches_reference(experts):
    """A rank holding experts 64..127 (``first_expert``) at the real shape."""
    from msa_kernels.mxfp8_moe_reference import reference_fused_experts
    from msa_kernels.triton_mxfp8_moe import mxfp8_fused_experts

    held = tuple(t[64:] for t in experts)
    x, ids, weights = routing(16, seed=7)
    got = mxfp8_fused_experts(x, *held, weights, ids, ALPHA, LIMIT, first_expert=64)
    assert_close(got, reference_fused_experts(x, *held, weights, ids, ALPHA, LIMIT, first_expert=64))


#: SGLang picks its flashinfer_trtllm MoE runner for any MXFP8 checkpoint on CUDA and then runs
#: flashinfer's autotune over a warm-up forward; the harness has no flashinfer (a stock install
#: does, and the M3 blocks call none of its kernels), so the harness servers skip that autotune.
HARNESS_FLAGS = ("--disable-flashinfer-autotune",)
#: the served comparisons' prompts (``tests/gpu/test_tiny_m3_gpu.py``'s ``PROMPTS``)
SERVED_PROMPTS = ("p61", "p233", "p457")
#: per served dtype: the short name in the server logs' names, the record file under ``$OUT``
DTYPE_LABELS = {"bfloat16": "bf16", "float32": "fp32"}
RECORD_FILES = {"bfloat16": "mxfp8_served_tiny.json", "float32": "mxfp8_served_tiny_fp32.json"}


def gpu_test_paths() -> None:
    """Makes the GPU tests' helpers (``tests/gpu``) and the e2e oracle (``tests/e2e``) importable."""
    sys.path.insert(0, os.path.dirname(__file__))
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "e2e"))


def serve_mxfp8_and_twin(tmp_path, server_log_dir, dtype: str, twin: str, env: dict[str, str] | None = None):
    """The tiny MXFP8 checkpoint (experts on the ``mxfp8`` path; ``env`` for its server) and its
    dequantized twin (MoE path ``twin``), each served in ``dtype`` on :data:`SERVED_PROMPTS`; each
    log must name its MoE path, the MXFP8 server's the weights it kept in MXFP8. Returns ``(dirs,
    prompts, served)``: checkpoint folder by mode, prompt ids by name, ``served[impl][name]`` the
    generate results."""
    gpu_test_paths()
    from gpu_server import launch_gpu_server, log_text
    from served_vs_reference import generate
    from test_tiny_m3_gpu import CHUNK, PROMPTS

    from sglang_m3.tiny.checkpoint import build_tiny_checkpoint

    dirs = {mode: build_tiny_checkpoint(str(tmp_path / mode), quantization=mode) for mode in ("mxfp8", "mxfp8-dequantized")}
    prompts = {name: PROMPTS[name] for name in SERVED_PROMPTS}
    served = {}
    for impl, mode, server_env in (("mxfp8", "mxfp8", env), (twin, "mxfp8-dequantized", None)):
        with launch_gpu_server(
            dirs[mode], server_log_dir, "--chunked-prefill-size", str(CHUNK), *HARNESS_FLAGS, env=server_env,
            name=f"{DTYPE_LABELS[dtype]}-{impl}-{mode}", dtype=dtype, prefill_graphs=False,
        ) as server:
            log = log_text(server)
            assert f"M3 MoE experts: {impl} path" in log
            if impl == "mxfp8":
                assert "kept 72 routed-expert and 28 linear weight(s) in MXFP8" in log  # 3 MoE layers x 8 experts x w1/w2/w3; 4 x q/k/v/o + 3 dense MLP + 3 x 3 shared
            served[impl] = {name: generate(server, p, logprob_start=0) for name, p in prompts.items()}
    return dirs, prompts, served


@pytest.mark.server
def test_served_mxfp8_checkpoint_within_bf16_noise(tmp_path, server_log_dir):
    gpu_test_paths()
    from served_vs_reference import NEW_TOKENS, output_ids
    from test_tiny_m3_gpu import BF16_NOISE_CEILING, FUSED_NOISE_RATIO, FUSED_NOISE_SLACK
    from test_tiny_m3_gpu import reference_gaps, served_logprobs
    from transformers_oracle import prompt_logprobs

    dirs, prompts, served = serve_mxfp8_and_twin(tmp_path, server_log_dir, "bfloat16", "fused")
    failures = []
    for name, prompt in prompts.items():
        reference_lp = prompt_logprobs(dirs["mxfp8-dequantized"], prompt)
        delta = {}
        for impl, results in served.items():
            diffs = [abs(v - reference_lp[p - 1].item()) for p, v in served_logprobs(results[name], prompt).items()]
            delta[impl] = max(diffs)
            gaps = reference_gaps(dirs["mxfp8-dequantized"], prompt, output_ids(results[name]))
            print(f"[gpu mxfp8 served] {impl} {name}: prompt logprob delta {delta[impl]:.3e}, served-token gaps max {max(gaps):.3e}")
            if delta[impl] > BF16_NOISE_CEILING:
                failures.append(f"{impl} {name}: prompt logprob noise {delta[impl]} over {BF16_NOISE_CEILING}")
            if max(gaps) > 2 * delta[impl]:
                failures.append(f"{impl} {name}: a served token is {max(gaps)} below the fp32 argmax (noise {delta[impl]})")
        if delta["mxfp8"] > FUSED_NOISE_RATIO * delta["fused"] + FUSED_NOISE_SLACK:
            failures.append(f"mxfp8 {name}: noise {delta['mxfp8']} vs the BF16 fused MoE's {delta['fused']}")
    write_served_record(served, prompts, served_logprobs, output_ids)
    assert NEW_TOKENS > 0 and not failures, failures


@pytest.mark.server
def test_served_mxfp8_fp32_greedy_identical_to_dequantized_twin(tmp_path, server_log_dir):
    """W8A32 served: the tiny MXFP8 checkpoint in fp32 (routed experts and dense linears kept in
    MXFP8, run with fp32 activations; decode graphs, prefill chunks of 112 tokens, so the GEMVs,
    the cores and the widen path all serve) against its dequantized twin in fp32 (static torch MoE,
    plain fp32 linears). Both multiply the same exact values (e4m3 -> fp32 is exact, the e8m0
    factors are powers of two) and differ only in summation order, so the greedy tokens must be
    identical on every prompt (the bf16 pair's differ: bf16 drift up to 1.14 nats), and every
    prompt logprob within ``LOGPROB_TOLERANCE`` (2e-3) of the twin's: the bound the fp32 server is
    held to against transformers, whose difference is summation order too (IEEE fp32 dots), which
    the tiny model's sharp logits amplify. ``moe_impl`` (``sglang_m3/models/fused_moe.py``) picks
    the MXFP8 experts for bf16 models only, so the MXFP8 server asks for them by name."""
    gpu_test_paths()
    from served_vs_reference import LOGPROB_TOLERANCE, NEW_TOKENS, output_ids
    from test_tiny_m3_gpu import served_logprobs

    from sglang_m3.models.fused_moe import MOE_IMPL_ENV

    _, prompts, served = serve_mxfp8_and_twin(tmp_path, server_log_dir, "float32", "static", env={MOE_IMPL_ENV: "mxfp8"})
    record = write_served_record(served, prompts, served_logprobs, output_ids, twin="static", dtype="float32")
    differing = [name for name in prompts if output_ids(served["mxfp8"][name]) != output_ids(served["static"][name])]
    assert NEW_TOKENS > 0 and not differing, f"greedy tokens differ from the dequantized twin's on {differing}"
    assert record["logprob_max_diff"] < LOGPROB_TOLERANCE, f"prompt logprobs differ by {record['logprob_max_diff']}"


def write_served_record(served: dict, prompts: dict, served_logprobs, output_ids, twin: str = "fused", dtype: str = "bfloat16") -> dict:
    """The MXFP8 server against its dequantized twin (``served[twin]``), both served in ``dtype``:
    whether the greedy tokens are identical on every prompt (in bf16 reported, not required) and
    the largest prompt-logprob difference between the two servers. Printed, returned, and written
    to ``$OUT`` (:data:`RECORD_FILES`) for ``benchmarks/quantized_gpu.py --tiny-json``."""
    identical = all(output_ids(served["mxfp8"][name]) == output_ids(served[twin][name]) for name in prompts)
    diffs = []
    for name, prompt in prompts.items():
        ours, theirs = served_logprobs(served["mxfp8"][name], prompt), served_logprobs(served[twin][name], prompt)
        diffs += [abs(ours[p] - theirs[p]) for p in ours.keys() & theirs.keys()]
    record = {"greedy_identical_to_dequantized": identical, "logprob_max_diff": max(diffs),
              "prompts": {name: len(prompt) for name, prompt in prompts.items()}, "dtype": dtype}
    print(f"[gpu mxfp8 served] vs dequantized twin: {record}")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], RECORD_FILES[dtype]), "w", encoding="utf-8") as handle:
            json.dump(record, handle, indent=2)
    return record


# ---------------------------------------------------------------- the GEMV path (msa_kernels.mxfp8_gemv)


@pytest.mark.parametrize("tokens", [1, 4, 8])
def test_gemv_m3_shape_matches_reference(experts, tokens):
    """The GEMV path (the inline-PTX e4m3 conversion runs only here) at the real shape, decode batch
    sizes up to the dispatch bound; token 0's routing repeated by the last token (shared experts)."""
    from msa_kernels.triton_mxfp8_moe import mxfp8_fused_experts

    x, ids, weights = routing(tokens, seed=300 + tokens)
    ids[-1] = ids[0]
    got = mxfp8_fused_experts(x, *experts, weights, ids, ALPHA, LIMIT, path="gemv")
    assert_close(got, reference(x, ids, weights, experts))
    assert torch.equal(mxfp8_fused_experts(x, *experts, weights, ids, ALPHA, LIMIT, path="gemv"), got), "two runs differ"


def test_gemv_is_the_decode_path():
    from msa_kernels.triton_mxfp8_moe import GEMV_MAX_TOKENS, gemm_path

    assert gemm_path(1) == gemm_path(GEMV_MAX_TOKENS) == "gemv" != gemm_path(GEMV_MAX_TOKENS + 1)


@pytest.mark.parametrize("tokens", [1, 4, 8])
def test_gemv_captured_in_a_cuda_graph_and_replayed_on_new_routing(experts, tokens):
    assert_graph_replays_new_routing(experts, tokens, 400 + tokens, 500 + 10 * tokens, path="gemv")


def test_gemv_rows_of_any_magnitude(experts):
    """Rows scaled by 2**20, 2**-40 and 0 among ordinary ones: the GEMV multiplies in fp32 and needs
    no prescale, each row within the bound of its own magnitude."""
    from msa_kernels.triton_mxfp8_moe import mxfp8_fused_experts

    x, ids, weights = routing(5, seed=19)
    factors = torch.tensor([2.0**20, 1.0, 2.0**-40, 0.0, 1.0], device="cuda")
    x = (x.float() * factors[:, None]).to(torch.bfloat16)
    got = mxfp8_fused_experts(x, *experts, weights, ids, ALPHA, LIMIT, path="gemv")
    want = reference(x, ids, weights, experts)
    assert torch.equal(got[3].float(), torch.zeros_like(want[3]))
    for row in (0, 1, 2, 4):
        assert_close(got[row : row + 1], want[row : row + 1])


def test_gemv_tp8_slice_and_expert_parallel_half(experts):
    """One TP8 rank's slice of every expert (intermediate 384: the gate/up tiles narrow, the down
    GEMV's K steps are 4 groups), and a rank holding experts 64..127 (slots elsewhere skipped)."""
    from msa_kernels.mxfp8_moe_reference import reference_fused_experts
    from msa_kernels.triton_mxfp8_moe import mxfp8_fused_experts

    w13, s13, w2, s2 = experts
    part = slice(0, INTER // 8)
    sliced = (
        torch.cat([w13[:, part], w13[:, INTER + part.start : INTER + part.stop]], dim=1).contiguous(),
        torch.cat([s13[:, part], s13[:, INTER + part.start : INTER + part.stop]], dim=1).contiguous(),
        w2[:, :, part].contiguous(),
        s2[:, :, part.start // 32 : part.stop // 32].contiguous(),
    )
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        for held, first, tokens in ((sliced, 0, 4), (tuple(t[64:] for t in experts), 64, 8)):
            x, ids, weights = routing(tokens, seed=600 + tokens)
            got = mxfp8_fused_experts(x, *held, weights, ids, ALPHA, LIMIT, first_expert=first, path="gemv")
            assert_close(got, reference_fused_experts(x, *held, weights, ids, ALPHA, LIMIT, first_expert=first))
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous


# ---------------------------------------------------------------- fp32 activations (W8A32)


@pytest.mark.parametrize("tokens, path", [(1, "gemv"), (8, "gemv"), (16, "gemv"), (17, "bf16"), (64, "bf16"), (512, "widen")])
def test_fp32_m3_shape_matches_fp32_reference(experts, tokens, path):
    """fp32 tokens at the real shape on the path an fp32 model takes at each count (the GEMV with
    Triton's e4m3 -> fp32 conversion, the core's fp32 IEEE dots, widen's): within summation-order
    noise of the fp32 reference (``mxfp8_moe_reference.assert_fp32_close``); two runs identical."""
    from msa_kernels.mxfp8_moe_reference import assert_fp32_close
    from msa_kernels.triton_mxfp8_moe import gemm_path, mxfp8_fused_experts

    assert gemm_path(tokens, torch.float32) == path
    x, ids, weights = routing(tokens, seed=700 + tokens, dtype=torch.float32)
    got = mxfp8_fused_experts(x, *experts, weights, ids, ALPHA, LIMIT)
    worst, rel = assert_fp32_close(got, reference(x, ids, weights, experts))
    print(f"[mxfp8 moe gpu fp32] T={tokens} {path}: relative error {rel:.2e}, max {worst:.2e} of scale")
    assert torch.equal(mxfp8_fused_experts(x, *experts, weights, ids, ALPHA, LIMIT), got), "two runs differ"


@pytest.mark.parametrize("tokens", [1, 8])
def test_fp32_gemv_captured_in_a_cuda_graph_and_replayed_on_new_routing(experts, tokens):
    """The fp32 decode step as the served decode graphs run it."""
    assert_graph_replays_new_routing(experts, tokens, 800 + tokens, 900 + 10 * tokens, dtype=torch.float32)
