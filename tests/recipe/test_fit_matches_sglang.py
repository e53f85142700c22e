"""KV bytes per token against SGLang 0.5.23's own M3 pool sizing (an independent oracle).

SGLang sizes the KV pool of a MiniMax M3 model with ``DefaultPoolConfigurator.
_compute_cell_size`` (main K/V of every layer on the stage + the index key of every K-only
sparse layer, heads from ``ModelConfig.get_num_kv_heads``). Here it runs on a ModelConfig
built from an M3-shaped config.json (the published geometry, no weights), with the runtime
facts it reads (attention TP size, hisparse off, fp8 attention GEMMs on or off) supplied
directly, and with SGLang's own ``get_pp_indices`` for pipeline stages.
"""

from __future__ import annotations

import json
import types

import pytest

from sglang_m3.recipe.fit import kv_bytes_per_token, pipeline_stages

torch = pytest.importorskip("torch")
pool_configurator = pytest.importorskip("sglang.srt.model_executor.pool_configurator")

DENSE_LAYERS, LAYERS = 3, 60


def m3_config() -> dict:
    """config.json of the shipped VL layout with M3's published text geometry (M3_FACTS s.1)."""
    sparse_flags = [0] * DENSE_LAYERS + [1] * (LAYERS - DENSE_LAYERS)
    text = {
        "model_type": "minimax_m3_vl_text", "vocab_size": 200064, "hidden_size": 6144,
        "intermediate_size": 3072, "dense_intermediate_size": 12288,
        "shared_intermediate_size": 3072, "num_hidden_layers": LAYERS,
        "num_attention_heads": 64, "num_key_value_heads": 4, "head_dim": 128, "rotary_dim": 64,
        "rope_parameters": {"rope_type": "default", "rope_theta": 5e6,
                            "partial_rotary_factor": 0.5},
        "max_position_embeddings": 1048576, "rms_norm_eps": 1e-6, "num_local_experts": 128,
        "num_experts_per_tok": 4, "routed_scaling_factor": 2.0,
        "layer_types": ["full_attention"] * DENSE_LAYERS + ["minimax_m3_sparse"] * 57,
        "mlp_layer_types": ["dense"] * DENSE_LAYERS + ["sparse"] * 57,
        "sparse_attention_config": {
            "use_sparse_attention": True, "sparse_index_dim": 128, "sparse_num_index_heads": 4,
            "sparse_topk_blocks": 16, "sparse_block_size": 128, "sparse_score_type": "max",
            "sparse_init_block": 0, "sparse_local_block": 1,
            "sparse_attention_freq": sparse_flags, "sparse_disable_index_value": sparse_flags,
        },
    }
    return {"architectures": ["MiniMaxM3SparseForCausalLM"], "model_type": "minimax_m3_vl",
            "dtype": "bfloat16", "text_config": text, "language_model_only": True}


@pytest.fixture(scope="module")
def model_config(tmp_path_factory):
    from sglang.srt.configs.model_config import ModelConfig, is_minimax_sparse

    directory = tmp_path_factory.mktemp("m3-config")
    (directory / "config.json").write_text(json.dumps(m3_config()))
    config = ModelConfig(str(directory), trust_remote_code=False, dtype="bfloat16")
    assert is_minimax_sparse(config.hf_config)
    return config


def sglang_cell_size(monkeypatch, model_config, *, attn_tp, kv_dtype, fp8_attn_gemm, layers):
    import sglang.srt.layers.cp.utils as cp_utils
    import sglang.srt.server_args as server_args

    parallel = types.SimpleNamespace(attn_tp_size=attn_tp, attn_dcp_size=1, attn_cp_size=1,
                                     enable_dsa_cache_layer_split=False)
    monkeypatch.setattr(pool_configurator, "get_parallel", lambda: parallel)
    monkeypatch.setattr(cp_utils, "get_parallel", lambda: parallel)
    monkeypatch.setattr(pool_configurator, "get_memory",
                        lambda: types.SimpleNamespace(enable_hisparse=False))
    monkeypatch.setattr(pool_configurator, "resolving_view", lambda view: view)
    monkeypatch.setattr(server_args, "m3_fp8_attn_gemm_enabled", lambda view: fp8_attn_gemm)
    kvc = types.SimpleNamespace(
        model_config=model_config, kv_cache_dtype=kv_dtype, model_dtype=torch.bfloat16,
        layer_info=types.SimpleNamespace(start_layer=layers[0], end_layer=layers[1]),
        server_args=types.SimpleNamespace(enable_hisparse=False), use_mla_backend=False,
        is_draft_worker=False)
    method = pool_configurator.DefaultPoolConfigurator._compute_cell_size
    return method(None, kvc, layers[1] - layers[0])


# (recipe KV dtype, SGLang KV dtype, fp8 attention GEMMs as on Blackwell with fp8_e4m3)
DTYPES = [("auto", torch.bfloat16, False), ("fp8_e5m2", torch.float8_e5m2, False),
          ("fp8_e4m3", torch.float8_e4m3fn, False), ("fp8_e4m3", torch.float8_e4m3fn, True)]


@pytest.mark.parametrize("attn_tp", [1, 2, 4, 8, 16])
@pytest.mark.parametrize("pp", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: f"{d[0]}-gemm{d[2]}")
def test_kv_bytes_per_token_equal_sglang_pool_cell_size(monkeypatch, model_config, attn_tp,
                                                          pp, dtype):
    from sglang.srt.distributed.utils import get_pp_indices

    recipe_dtype, kv_dtype, fp8_gemm = dtype
    fullest = max(
        sglang_cell_size(monkeypatch, model_config, attn_tp=attn_tp, kv_dtype=kv_dtype,
                         fp8_attn_gemm=fp8_gemm, layers=get_pp_indices(LAYERS, rank, pp))
        for rank in range(pp)
    )
    assert kv_bytes_per_token(recipe_dtype, attn_tp, pp, index_fp8=fp8_gemm) == fullest


@pytest.mark.parametrize("pp", range(1, 13))
def test_pipeline_stages_equal_sglang_partition(pp):
    from sglang.srt.distributed.utils import get_pp_indices

    ours = [(stage.start, stage.stop) for stage in pipeline_stages(LAYERS, pp)]
    assert ours == [get_pp_indices(LAYERS, rank, pp) for rank in range(pp)]
