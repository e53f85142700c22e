"""KV bytes per token against the pool sizing SGLang 0.5.23 runs for M3.

SGLang sizes a KV pool with ``DefaultPoolConfigurator._compute_cell_size``. Its own M3 branch
(main K/V of every layer on the stage + the index key of every K-only sparse layer, heads from
``ModelConfig.get_num_kv_heads``) is an independent oracle where its index key is bf16, i.e.
without fp8 attention GEMMs. Served through the plugin, M3 takes the MHA branch instead (the
plugin turns ``is_minimax_sparse`` off) and the plugin's hook adds the index keys of its own pool,
bf16 under any KV dtype unless indexKeyDtype says fp8_e4m3: that sum is what the fit must equal
for every KV dtype. Both run on a ModelConfig built from an M3-shaped config.json (the published
geometry, no weights), with the runtime facts they read (attention TP size, hisparse off, fp8
attention GEMMs off) supplied directly, and with SGLang's own ``get_pp_indices`` for stages.
"""

from __future__ import annotations

import json
import types

import pytest

from sglang_m3.recipe.fit import kv_bytes_per_token, pipeline_stages
from sglang_m3.recipe.render import INDEX_KEY_DTYPE_ENV

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


def sglang_cell_size(monkeypatch, model_config, *, attn_tp, dtype, layers, plugin):
    """One stage's cell size; ``plugin``: as served through the plugin (MHA cell + its hook)."""
    import sglang.srt.layers.cp.utils as cp_utils
    import sglang.srt.server_args as server_args

    from sglang_m3.integration.hooks import add_index_key_bytes, upstream_minimax_sparse_wiring_off

    parallel = types.SimpleNamespace(attn_tp_size=attn_tp, attn_dcp_size=1, attn_cp_size=1,
                                     enable_dsa_cache_layer_split=False)
    monkeypatch.setattr(pool_configurator, "get_parallel", lambda: parallel)
    monkeypatch.setattr(cp_utils, "get_parallel", lambda: parallel)
    monkeypatch.setattr(pool_configurator, "get_memory",
                        lambda: types.SimpleNamespace(enable_hisparse=False))
    monkeypatch.setattr(pool_configurator, "resolving_view", lambda view: view)
    monkeypatch.setattr(server_args, "m3_fp8_attn_gemm_enabled", lambda view: False)
    if plugin:
        monkeypatch.setattr(pool_configurator, "is_minimax_sparse", upstream_minimax_sparse_wiring_off)
    kvc = types.SimpleNamespace(
        model_config=model_config, kv_cache_dtype=dtype[1], model_dtype=torch.bfloat16,
        layer_info=types.SimpleNamespace(start_layer=layers[0], end_layer=layers[1]),
        server_args=types.SimpleNamespace(enable_hisparse=False), use_mla_backend=False,
        is_draft_worker=False)
    num_layers = layers[1] - layers[0]
    # the configurator's __init__ sizes the whole pool; the cell size reads only the flag's text
    configurator = object.__new__(pool_configurator.DefaultPoolConfigurator)
    configurator.kv_cache_dtype_str = dtype[0]
    cell = configurator._compute_cell_size(kvc, num_layers)
    return add_index_key_bytes(cell, None, kvc, num_layers) if plugin else cell


# (recipe KV dtype, SGLang KV dtype)
DTYPES = [("auto", torch.bfloat16), ("fp8_e5m2", torch.float8_e5m2),
          ("fp8_e4m3", torch.float8_e4m3fn)]


def fullest_stage(monkeypatch, model_config, attn_tp, pp, dtype, plugin):
    from sglang.srt.distributed.utils import get_pp_indices

    return max(
        sglang_cell_size(monkeypatch, model_config, attn_tp=attn_tp, dtype=dtype,
                         layers=get_pp_indices(LAYERS, rank, pp), plugin=plugin)
        for rank in range(pp)
    )


@pytest.mark.parametrize("attn_tp", [1, 2, 4, 8, 16])
@pytest.mark.parametrize("pp", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d[0])
def test_kv_bytes_per_token_equal_sglang_m3_pool_cell_size(monkeypatch, model_config, attn_tp,
                                                             pp, dtype):
    fullest = fullest_stage(monkeypatch, model_config, attn_tp, pp, dtype, plugin=False)
    assert kv_bytes_per_token(dtype[0], attn_tp, pp) == fullest


@pytest.mark.parametrize("attn_tp", [1, 2, 4, 8, 16])
@pytest.mark.parametrize("pp", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d[0])
@pytest.mark.parametrize("index_key_dtype", ["bf16", "fp8_e4m3"])
def test_kv_bytes_per_token_equal_the_plugin_pool_cell_size(monkeypatch, model_config, attn_tp,
                                                              pp, dtype, index_key_dtype):
    monkeypatch.setenv(INDEX_KEY_DTYPE_ENV, index_key_dtype)
    fullest = fullest_stage(monkeypatch, model_config, attn_tp, pp, dtype, plugin=True)
    assert kv_bytes_per_token(dtype[0], attn_tp, pp, index_key_dtype=index_key_dtype) == fullest


@pytest.mark.parametrize("pp", range(1, 13))
def test_pipeline_stages_equal_sglang_partition(pp):
    from sglang.srt.distributed.utils import get_pp_indices

    ours = [(stage.start, stage.stop) for stage in pipeline_stages(LAYERS, pp)]
    assert ours == [get_pp_indices(LAYERS, rank, pp) for rank in range(pp)]
