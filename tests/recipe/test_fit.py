"""Memory fit against hand computations (arithmetic written out, from M3_FACTS s.1 and s.6).

Weights per GPU rank come from the bytes ``sglang-m3 inspect`` measured per sharding group
(``sglang_m3/recipe/data/m3_geometry.json``); at TP8 one rank holds, in bf16 (router fp32):
  q/o projections 60 x 2 x (64 x 128) x 6144 x 2 B / 8            =   1,509,949,440
  k/v projections 60 x 2 x (4 x 128) x 6144 x 2 B / 4 (2 replicas) =     188,743,680
  embedding + lm_head 2 x 200,064 x 6144 x 2 B, dense MLPs 3 x 3 x 12,288 x 6144 x 2 B,
  shared experts 57 x 3 x 3072 x 6144 x 2 B, all / 8               =   1,591,345,152
  routed experts 57 x 128 x 3 x 3072 x 6144 x 2 B / 8              = 103,280,541,696
  whole on every rank: vision tower 865,567,232 x 2 B, norms, index q/k projections
  57 x 5 x 128 x 6144 x 2 B, routers 57 x (128 x 6144 + 128) x 4 B =   2,360,283,136
                                                             total = 108,930,863,104

Per token per GPU rank, bf16 (2 bytes):
  main KV per layer = 2 (K and V) x KV heads on the rank x 128 (head dim) x 2 bytes
  index key per sparse layer = 128 x 2 bytes = 256 bytes (one head, on every rank)
At attention-TP >= 4 a rank holds 1 KV head: 2 x 1 x 128 x 2 = 512 bytes per layer.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_m3.recipe import estimate_fit, fit_applies, load_recipe, validate_recipe
from sglang_m3.recipe.fit import kv_bytes_per_token, weight_bytes_per_gpu
from tests.recipe.recipe_factory import LIBRARY, make_recipe

GB = 10**9
BF16_TOTAL = 854_169_948_160  # the whole model as built, inspect's "as_built" bytes
TP8_RANK = 108_930_863_104  # one TP8 rank, by hand in the module docstring
TP8_MXFP8 = 57_608_433_664  # one TP8 rank of the MXFP8 checkpoint, by hand in test_weights_per_rank_by_hand


def test_kv_bytes_per_token_by_hand():
    # TP8 (and TP4): 1 KV head per rank. 60 layers x 512 + 57 sparse layers x 256
    assert kv_bytes_per_token("auto", attention_tp=8, pp=1) == 60 * 512 + 57 * 256 == 45_312
    assert kv_bytes_per_token("bf16", attention_tp=4, pp=1) == 45_312
    # TP2: 2 KV heads per rank: 60 x (2 x 2 x 128 x 2 = 1024) + 57 x 256
    assert kv_bytes_per_token("auto", attention_tp=2, pp=1) == 60 * 1024 + 14_592 == 76_032
    # TP1: all 4 KV heads: 60 x 2048 + 57 x 256 (M3_FACTS s.3: dense GQA reads 2048 B/layer)
    assert kv_bytes_per_token("auto", attention_tp=1, pp=1) == 122_880 + 14_592 == 137_472
    # fp8 KV halves the main KV: 60 x 256; the index key stays bf16 (57 x 256) ...
    assert kv_bytes_per_token("fp8_e5m2", attention_tp=8, pp=1) == 15_360 + 14_592 == 29_952
    assert kv_bytes_per_token("fp8_e4m3", attention_tp=8, pp=1) == 15_360 + 14_592 == 29_952
    # ... unless indexKeyDtype asks for fp8 index keys: 57 x (128 + a 4-byte scale)
    assert kv_bytes_per_token("fp8_e4m3", 8, 1, index_key_dtype="fp8_e4m3") == 15_360 + 7_524 == 22_884
    # PP2: layers 0-29 and 30-59; the second stage is all sparse: 30 x 512 + 30 x 256
    assert kv_bytes_per_token("auto", attention_tp=8, pp=2) == 30 * 512 + 30 * 256 == 23_040
    # PP7: 60 = 7 x 8 + 4, the last 4 stages hold 9 layers, all sparse: 9 x (512 + 256)
    assert kv_bytes_per_token("auto", attention_tp=8, pp=7) == 9 * 768 == 6_912


def test_index_key_stays_bf16_under_an_fp8_kv_cache_on_every_gpu():
    # the plugin's pool keeps the index key in the model dtype under any 8-bit KV cache (SGLang's
    # own M3 pool, which would store it in fp8 with fp8_e4m3 on Hopper and Blackwell, does not
    # serve): 60 x 256 K/V + 57 x 256 index key = 29,952 bytes at TP8, whatever the hardware
    for profile in ("b200", "h100", "h200", "mi355x"):
        for dtype in ("fp8_e4m3", "fp8_e5m2"):
            recipe = make_recipe(spec__kvCache={"dtype": dtype}, spec__hardware={"profile": profile})
            assert estimate_fit(recipe).kv_bytes_per_token == 29_952, (profile, dtype)


def test_weights_per_rank_by_hand():
    assert weight_bytes_per_gpu("bf16", 8, 1) == (
        1_509_949_440 + 188_743_680 + 1_591_345_152 + 103_280_541_696 + 2_360_283_136) == TP8_RANK
    assert weight_bytes_per_gpu("bf16", 1, 1) == BF16_TOTAL
    # MXFP8 (inspect's MXFP8 layout): the sharded linears in the layers at 33/32 bytes per
    # element (e4m3 + one e8m0 scale byte per 32), embedding/lm_head and replicated parts as bf16:
    #   q/o 60 x 2 x 8192 x 6144 x 33/32 / 8 = 778,567,680; k/v 60 x 2 x 512 x 6144 x 33/32 / 4
    #   = 97,320,960; embedding + lm_head 614,596,608 + dense MLPs 3 x 3 x 12,288 x 6144 x 33/32 / 8
    #   = 87,588,864 + shared experts 57 x 3 x 3072 x 6144 x 33/32 / 8 = 416,047,104;
    #   routed experts 57 x 128 x 3 x 3072 x 6144 x 33/32 / 8 = 53,254,029,312; replicated as bf16
    assert weight_bytes_per_gpu("mxfp8", 8, 1) == (
        778_567_680 + 97_320_960 + 614_596_608 + 87_588_864 + 416_047_104 + 53_254_029_312
        + 2_360_283_136) == TP8_MXFP8


def test_h200_bf16_tp8_library_recipe_by_hand():
    report = estimate_fit(load_recipe(LIBRARY / "h200-bf16-tp8.yaml"))
    # weights: one TP8 rank (module docstring)
    assert report.weight_bytes_per_gpu == TP8_RANK
    assert report.kv_heads_per_rank == 1 and report.kv_replication == 2  # 4 KV heads on 8 ranks
    # static budget: 141 GB x 0.88 = 124.08 GB; KV pool = 124.08e9 - 108,930,863,104
    assert report.static_budget_bytes == 124_080_000_000
    assert report.kv_pool_bytes == 15_149_136_896
    # 15,149,136,896 / 45,312 = 334,329.6 tokens -> whole pages of 128: 2,611 x 128 = 334,208
    assert report.pool_tokens == 334_208
    # at 131,072 tokens per request: 334,208 // 131,072 = 2 requests
    assert report.max_concurrency_at_context == 2
    # at 2 requests: 334,208 / 2 = 167,104 -> whole pages: 1,305 x 128 = 167,040
    assert report.max_context_at_concurrency == 167_040
    # reserve: 8192-token chunk x 6144 x 2 B x 16 + 2 requests x 200,064 x 4 B logits + 2 GB
    assert report.reserve_bytes == 8192 * 6144 * 32 + 2 * 200_064 * 4 + 2 * GB == 3_612_213_248
    assert report.findings() == []


def test_h100_bf16_tp8_pp2_by_hand():
    report = estimate_fit(load_recipe(LIBRARY / "h100-bf16-tp8-pp2.yaml"))
    # second stage: layers 30-59, all MSA+MoE, each at TP8 25,165,824 (q/o) + 3,145,728 (k/v)
    # + 14,155,776 (shared expert) + 1,811,939,328 (routed) + 11,036,160 (whole) bytes, plus
    # lm_head 307,298,304 and the final norm 12,288; the first stage (3 dense + 27 sparse
    # layers, embedding, vision tower) holds 52,660,268,032
    sparse_layer = 25_165_824 + 3_145_728 + 14_155_776 + 1_811_939_328 + 11_036_160
    assert report.weight_bytes_per_gpu == 30 * sparse_layer + 307_298_304 + 12_288 == 56_270_595_072
    # 80 GB x 0.88 = 70.4 GB static; 70.4e9 - 56,270,595,072 = 14,129,404,928 of KV; the
    # second stage needs 30 x 512 + 30 x 256 = 23,040 bytes per token
    # 14,129,404,928 / 23,040 = 613,255.4 -> 4,791 pages x 128 = 613,248
    assert report.kv_bytes_per_token == 23_040
    assert report.pool_tokens == 613_248
    assert report.max_concurrency_at_context == 613_248 // 131_072 == 4


def test_b300_1m_context_fit_by_hand():
    report = estimate_fit(load_recipe(LIBRARY / "b300-mxfp8-tp8-1m-context.yaml"))
    # 57,608,433,664 weights (MXFP8 at TP8); 288 GB x 0.85 = 244.8 GB static
    assert report.weight_bytes_per_gpu == TP8_MXFP8
    # 187,191,566,336 / 45,312 = 4,131,169.8 -> 32,274 pages x 128 = 4,131,072 tokens
    assert report.pool_tokens == 4_131_072
    # one 1M request needs 1,048,576 x 45,312 = 47.51 GB; 4,131,072 // 1,048,576 = 3
    assert report.max_concurrency_at_context == 3
    # at 3 requests: 4,164,096 / 3 = 1,388,032 tokens each, capped at M3's 1,048,576
    assert report.max_context_at_concurrency == 1_048_576
    assert report.findings() == []


def test_attention_dp_replicates_attention_weights_by_hand():
    # B200 MXFP8, tp 8 with attentionDp 8: each rank is its own attention group (attention-TP 1)
    recipe = make_recipe(spec__parallelism={"tp": 8, "ep": 8, "attentionDp": 8},
                         spec__serving={"memFractionStatic": 0.8, "maxRunningRequests": 16})
    report = estimate_fit(recipe)
    # q/o (12,079,595,520 bytes in bf16) and k/v (754,974,720) whole on every rank, the rest
    # as at TP8; in MXFP8 q/o are 6,228,541,440 and k/v 389,283,840 (33/32 bytes per element)
    bf16 = 12_079_595_520 + 754_974_720 + 1_591_345_152 + 103_280_541_696 + 2_360_283_136
    assert weight_bytes_per_gpu("bf16", 8, 1, attention_dp=8) == bf16 == 120_066_740_224
    mxfp8 = 6_228_541_440 + 389_283_840 + 1_118_232_576 + 53_254_029_312 + 2_360_283_136
    assert report.weight_bytes_per_gpu == mxfp8 == 63_350_370_304
    # attention-TP 1 keeps all 4 KV heads: 137,472 bytes per token
    assert report.kv_heads_per_rank == 4 and report.kv_bytes_per_token == 137_472
    # 180 GB x 0.8 = 144 GB static; (144e9 - 63,350,370,304) / 137,472 = 586,662.2 -> 586,624
    assert report.pool_tokens == 586_624
    # 16 requests over 8 attention groups = 2 per group; 586,624 // 2 = 293,312 -> 2,291 pages
    assert report.requests_per_group == 2
    assert report.max_context_at_concurrency == 2_291 * 128 == 293_248
    assert weight_bytes_per_gpu("mxfp8", 8, 1, attention_dp=8) == report.weight_bytes_per_gpu


def test_eagle3_draft_weights_counted_by_hand():
    report = estimate_fit(load_recipe(LIBRARY / "b200-mxfp8-tp4-eagle3.yaml"))
    # target MXFP8 at TP4 112,759,263,232 (the TP8 groups of test_weights_per_rank_by_hand x 2,
    # replicated 2,360,283,136 once); draft 3.3e9 params x 2 bytes / 4 = 1.65 GB
    assert report.draft_bytes_per_gpu == 1_650_000_000
    assert report.weight_bytes_per_gpu == weight_bytes_per_gpu("mxfp8", 4, 1) + 1_650_000_000 == 114_409_263_232
    # 180 x 0.75 = 135 GB static; 135e9 - 114,409,263,232 = 20,590,736,768; / 45,312
    # = 454,421.3 -> 454,400
    assert report.pool_tokens == 454_400
    assert report.max_concurrency_at_context == 3


def test_bf16_on_one_h100_node_is_impossible():
    recipe = make_recipe(spec__hardware={"profile": "h100"},
                         spec__model={"path": "MiniMaxAI/MiniMax-M3", "variant": "bf16"},
                         spec__parallelism={"tp": 8})
    report = estimate_fit(recipe)
    # 108.93 GB of weights per TP8 rank > 80 x 0.8 = 64 GB
    assert report.kv_pool_bytes == 0 and report.pool_tokens == 0
    [finding] = report.findings()
    assert (finding.severity, finding.rule, finding.field) == ("error", "fit.weights", "spec.parallelism")
    assert "108.9 GB per GPU" in finding.message and "64.0 GB" in finding.message


def test_context_beyond_pool_is_an_error_and_concurrency_shortfall_a_warning():
    h200 = dict(spec__hardware={"profile": "h200"},
                spec__model={"path": "MiniMaxAI/MiniMax-M3", "variant": "bf16"},
                spec__parallelism={"tp": 8})
    # 141 x 0.88 = 124.08 GB static -> 334,208 KV tokens (as in the H200 test above)
    too_long = estimate_fit(make_recipe(**h200, spec__contextLength=400_000,
                                        spec__serving={"memFractionStatic": 0.88}))
    assert [f.rule for f in too_long.findings()] == ["fit.context"]
    assert "at most 334,208" in too_long.findings()[0].message
    crowded = estimate_fit(make_recipe(**h200, spec__contextLength=131_072,
                                       spec__serving={"memFractionStatic": 0.88,
                                                      "maxRunningRequests": 3}))
    # 334,208 // 131,072 = 2 < 3 requested
    [finding] = crowded.findings()
    assert (finding.severity, finding.rule) == ("warning", "fit.concurrency")
    assert "only 2 request(s)" in finding.message


def test_thin_kv_pool_and_small_reserve_are_warnings():
    # 8 x H200 at 0.80: 112.8 GB static - 108.93 = 3.87 GB of KV, under 10% of 112.8 GB
    thin = estimate_fit(make_recipe(
        spec__hardware={"profile": "h200"},
        spec__model={"path": "MiniMaxAI/MiniMax-M3", "variant": "bf16"},
        spec__parallelism={"tp": 8}, spec__contextLength=8192,
        spec__serving={"memFractionStatic": 0.80, "maxRunningRequests": 1}))
    assert "fit.tight" in [f.rule for f in thin.findings()]
    # B300 at 0.99 leaves 2.88 GB, less than the 2 GB graphs + 1.6 GB chunk activations
    squeezed = estimate_fit(make_recipe(
        spec__hardware={"profile": "b300"},
        spec__serving={"memFractionStatic": 0.99, "maxRunningRequests": 1}))
    assert "fit.reserve" in [f.rule for f in squeezed.findings()]


def test_cpu_profile_is_outside_the_fit():
    recipe = load_recipe(LIBRARY / "cpu-tiny.yaml")
    assert not fit_applies(recipe)
    assert not [f for f in validate_recipe(recipe) if f.rule.startswith("fit.")]


# --- properties --------------------------------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(low=st.floats(0.3, 0.9), high=st.floats(0.3, 0.9), context=st.integers(1024, 1_048_576),
       running=st.integers(1, 256), profile=st.sampled_from(["b200", "b300", "mi355x", "gb200"]))
def test_more_memory_fraction_never_shrinks_the_pool(low, high, context, running, profile):
    low, high = sorted((low, high))
    reports = [estimate_fit(make_recipe(
        spec__hardware={"profile": profile, "gpusPerNode": 4}, spec__parallelism={"tp": 4},
        spec__contextLength=context,
        spec__serving={"memFractionStatic": fraction, "maxRunningRequests": running}))
        for fraction in (low, high)]
    assert reports[0].pool_tokens <= reports[1].pool_tokens
    for report in reports:
        # what the report promises fits in the pool it reports
        assert report.max_concurrency_at_context * context <= report.pool_tokens
        assert report.max_context_at_concurrency * report.requests_per_group <= report.pool_tokens
        assert report.pool_tokens % 128 == 0


@settings(max_examples=100, deadline=None)
@given(variant=st.sampled_from(["bf16", "mxfp8"]), dtype=st.sampled_from(["auto", "fp8_e4m3"]),
       pp=st.integers(1, 8), index_key_dtype=st.sampled_from(["bf16", "fp8_e4m3"]))
def test_more_tensor_parallelism_never_costs_more_per_gpu(variant, dtype, pp, index_key_dtype):
    tps = [1, 2, 4, 8, 16, 32, 64]
    weights = [weight_bytes_per_gpu(variant, tp, pp) for tp in tps]
    kv = [kv_bytes_per_token(dtype, tp, pp, index_key_dtype=index_key_dtype) for tp in tps]
    assert weights == sorted(weights, reverse=True)
    assert kv == sorted(kv, reverse=True)
    assert kv[2:] == [kv[2]] * (len(tps) - 2)  # from tp 4 on, KV heads are replicated


def test_max_total_tokens_caps_the_pool():
    # B200 TP8 MXFP8 at 0.8: 144 GB - 56.11 GB = 87.89 GB / 45,312 -> 1,939,584 tokens (page-rounded),
    # but SGLang never allocates more than maxTotalTokens
    capped = estimate_fit(make_recipe(spec__serving={"memFractionStatic": 0.8,
                                                     "maxRunningRequests": 2,
                                                     "maxTotalTokens": 300_000}))
    assert capped.pool_tokens == 300_000 and capped.pool_capped
    assert capped.max_concurrency_at_context == 300_000 // 131_072 == 2
    assert capped.findings() == []
